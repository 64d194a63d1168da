"""Model configuration: Llama-family shapes, the residual layout, and named presets.

The config describes the *whole* model. Tensor parallelism never mutates it: the model computes its
local head counts from the TP degree it is built with (see `ladder.model.transformer`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ladder.errors import LadderError
from ladder.options import CPU_DTYPE, environment_value

LAYOUTS = ("standard", "parallel", "ladder", "desync", "upper-bound")
"""Residual layouts; exact semantics in docs/layouts.md. Hybrid is `ladder` with `ladder_layers < n_layers`."""

DESYNC_PATTERNS = ("mlp", "attention", "all", "none")
"""Which module outputs a desync model all-reduces (the last module is always reduced)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The dtypes ladder runs in (`--dtype`), by name, and their size."""


DEFAULT_DTYPE_HELP = ("default: bfloat16 on CUDA and on a CPU with bf16 instructions (AVX-512 BF16, AMX), else "
                      f"float32 (${CPU_DTYPE} pins the CPU's)")


def default_dtype(device_type: str, quantize: str | None = None) -> str:
    """The dtype when none is asked for, the faster one: bfloat16 on CUDA (2 bytes, as the paper's fp16)
    and on a CPU that computes in bf16 (its bf16 linear layers ran 2.1x faster than fp32's on an AVX-512
    BF16 CPU); float32 on other CPUs, which convert bf16 in software (a batch-8 server step on an AVX2
    EPYC: 3x slower in bf16; docs/serving.md), unless the weights are quantized: torch's int8 and int4 CPU
    kernels are vectorized for bf16 activations (SmolLM2's eager decode there, int8: 30.8 tok/s in bf16,
    10.8 in fp32; int4: 32.2 and 7.6; unquantized fp32: 24.6; docs/quantization.md)."""
    if device_type != "cpu":
        return "bfloat16" if device_type == "cuda" else "float32"
    if pinned := environment_value(CPU_DTYPE):
        if pinned not in DTYPE_BYTES:
            raise LadderError(f"{CPU_DTYPE}={pinned!r} is not one of {', '.join(DTYPE_BYTES)}")
        return pinned
    return "bfloat16" if cpu_computes_in_bf16() or quantize else "float32"


@functools.cache
def cpu_computes_in_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic: AVX-512 BF16 or AMX tiles (PyTorch's own CPU checks)."""
    return cpu_has_amx() or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (bf16 matrix products in hardware)."""
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (`rope_type: llama3` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (pre-RMSNorm, RoPE, GQA attention, SwiGLU MLP) plus its residual layout."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    layout: str = "standard"
    ladder_layers: int | None = None  # ladder on the last N layers; None means all (ladder layout only)
    desync_reduce: str = "mlp"
    desync_tp: int | None = None  # the TP degree a trained desync model is defined for (None: any, random weights)
    source: str = ""  # the public model whose shape this mirrors
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        layout = self.layout.replace("_", "-")
        if layout == "hybrid":
            layout = "ladder"
        object.__setattr__(self, "layout", layout)
        if layout not in LAYOUTS:
            raise LadderError(f"unknown layout {self.layout!r}; known layouts: {', '.join(LAYOUTS)}")
        if self.desync_reduce not in DESYNC_PATTERNS:
            raise LadderError(
                f"unknown desync reduce pattern {self.desync_reduce!r}; known: {', '.join(DESYNC_PATTERNS)}"
            )
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise LadderError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise LadderError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise LadderError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise LadderError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.ladder_layers is not None:
            if layout != "ladder":
                raise LadderError(f"ladder_layers is set ({self.ladder_layers}) but the layout is {layout!r}")
            if not 0 <= self.ladder_layers <= self.n_layers:
                raise LadderError(
                    f"ladder_layers must be between 0 and n_layers={self.n_layers}, got {self.ladder_layers}"
                )

        if self.desync_tp is not None:
            if layout != "desync":
                raise LadderError(f"desync_tp is set ({self.desync_tp}) but the layout is {layout!r}")
            if self.desync_tp < 1:
                raise LadderError(f"desync_tp must be >= 1, got {self.desync_tp}")

    # ---- the layout, module by module -------------------------------------------------------------

    @property
    def n_ladder_layers(self) -> int:
        """How many trailing layers follow the ladder recurrence (0 unless the layout is ladder)."""
        if self.layout != "ladder":
            return 0
        return self.n_layers if self.ladder_layers is None else self.ladder_layers

    def canonical(self) -> ModelConfig:
        """This model with equivalent spellings unified (ladder on all layers: None or n_layers; the
        source label), so two configs of one model compare equal."""
        ladder_layers = self.n_ladder_layers if self.layout == "ladder" else None
        return self.replace(ladder_layers=ladder_layers, source="")

    @property
    def first_ladder_layer(self) -> int:
        """The first layer that follows the ladder recurrence (n_layers when none does)."""
        return self.n_layers - self.n_ladder_layers

    def desync_reduces(self, module: int) -> bool:
        """Whether module `module` (0-based, execution order A_0, M_0, A_1, ...) is all-reduced in desync."""
        if module == 2 * self.n_layers - 1:
            return True  # the head must see one stream
        is_mlp = module % 2 == 1
        return {"all": True, "none": False, "mlp": is_mlp, "attention": not is_mlp}[self.desync_reduce]

    @property
    def layout_name(self) -> str:
        """Human-readable layout, e.g. `ladder`, `hybrid (ladder on last 8 of 30 layers)`."""
        n = self.n_ladder_layers
        if self.layout == "ladder" and n < self.n_layers:
            return f"hybrid (ladder on last {n} of {self.n_layers} layers)"
        if self.layout == "desync":
            trained = f", for tp={self.desync_tp}" if self.desync_tp else ""
            return f"desync (reduce {self.desync_reduce}{trained})"
        return self.layout

    # ---- tensor parallelism ----------------------------------------------------------------------

    def check_tp(self, tp: int) -> None:
        """Raise a one-line error naming the numbers if this shape cannot be sharded over `tp` ranks.

        Attention is sharded by whole KV groups (a KV head with its query heads): evenly when tp divides
        n_kv_heads, unevenly (some ranks hold one group more) when tp is smaller than n_kv_heads, and
        with replicated KV heads when tp is a multiple of n_kv_heads.
        """
        if tp < 1:
            raise LadderError(f"tensor-parallel degree must be >= 1, got {tp}")
        if not self._heads_shard(tp):
            raise LadderError(f"n_heads {self.n_heads} with n_kv_heads {self.n_kv_heads} cannot be sharded over "
                              f"tensor-parallel degree {tp} ({self._valid_tp_text()})")
        if self.ffn_hidden % tp:
            raise LadderError(f"ffn_hidden {self.ffn_hidden} is not divisible by tensor-parallel degree {tp} "
                              f"({self._valid_tp_text()})")

    def _heads_shard(self, tp: int) -> bool:
        kv = self.n_kv_heads
        return not (kv % tp and tp > kv and (tp % kv or self.n_heads % tp))

    def valid_tp_degrees(self) -> list[int]:
        """Every TP degree this shape can be sharded over (none exceeds n_heads)."""
        return [tp for tp in range(1, self.n_heads + 1) if self._heads_shard(tp) and self.ffn_hidden % tp == 0]

    def _valid_tp_text(self) -> str:
        return "this shape shards over tp " + ", ".join(map(str, self.valid_tp_degrees()))

    def check_run_tp(self, tp: int) -> None:
        """`check_tp`, plus: a trained desync model computes its trained function only at its own TP degree."""
        self.check_tp(tp)
        if self.layout == "desync" and self.desync_tp is not None and tp != self.desync_tp:
            raise LadderError(f"this desync model was trained for tensor-parallel degree {self.desync_tp} (each rank "
                              f"keeps its own residual stream); run it with --tp {self.desync_tp}, not {tp}")

    def balanced_tp(self, tp: int) -> bool:
        """Whether every rank holds the same number of attention heads at this TP degree."""
        return self.n_heads % tp == 0 and (self.n_kv_heads % tp == 0 or tp % self.n_kv_heads == 0)

    # ---- derived numbers -------------------------------------------------------------------------

    def n_params(self) -> int:
        """Parameter count of the unsharded model."""
        kv_dim = self.n_kv_heads * self.head_dim
        attn = self.dim * (self.dim + 2 * kv_dim) + self.dim * self.dim
        mlp = 3 * self.dim * self.ffn_hidden
        norms = (1 if self.layout == "parallel" else 2) * self.dim
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + norms) + embed + self.dim

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        if changes.get("layout") not in (None, "ladder") and "ladder_layers" not in changes:
            changes["ladder_layers"] = None
        if changes.get("layout") not in (None, "desync") and "desync_tp" not in changes:
            changes["desync_tp"] = None  # a desync model's rank count means nothing in another layout
        return dataclasses.replace(self, **changes)

    # ---- persistence -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("head_dim")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LadderError(f"unknown config keys: {', '.join(unknown)}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass(frozen=True)
class ShardShape:
    """The local sizes of one tensor-parallel rank."""

    n_heads: int  # query heads on this rank
    n_kv_heads: int  # key/value heads on this rank
    first_head: int  # global index of this rank's first query head
    first_kv_head: int  # global index of this rank's first key/value head
    ffn_hidden: int
    vocab_size: int  # output-head rows on this rank (all of them unless the vocabulary is sharded)
    first_vocab_row: int

    @staticmethod
    def of(config: ModelConfig, rank: int, tp: int, shard_vocab: bool = False) -> ShardShape:
        config.check_tp(tp)
        kv, group = config.n_kv_heads, config.n_heads // config.n_kv_heads
        if tp > kv:  # each KV head is replicated on tp / kv consecutive ranks, its query heads split
            n_heads, n_kv = config.n_heads // tp, 1
            first_head, first_kv = rank * n_heads, rank * kv // tp
        else:  # whole KV groups; with tp not dividing kv, the first kv % tp ranks get one group more
            first_kv, last_kv = rank * kv // tp, (rank + 1) * kv // tp
            n_kv, n_heads, first_head = last_kv - first_kv, (last_kv - first_kv) * group, first_kv * group
        vocab = config.vocab_size // tp if shard_vocab else config.vocab_size
        first_vocab = rank * vocab if shard_vocab else 0
        return ShardShape(n_heads, n_kv, first_head, first_kv, config.ffn_hidden // tp, vocab, first_vocab)


_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=160, vocab_size=256,
                        max_seq_len=128, source="a few-layer toy for tests"),
    "smollm2-135m": ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden=1536,
                                vocab_size=49152, rope_theta=100000.0, max_seq_len=8192,
                                tie_embeddings=True, source="HuggingFaceTB/SmolLM2-135M"),
    "llama-160m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_hidden=3072,
                              vocab_size=32000, max_seq_len=2048, source="JackFram/llama-160m (CPU benchmarks)"),
    "byte-4m": ModelConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden=704, vocab_size=256,
                           max_seq_len=512, source="a 4.5M-parameter byte-level model for CPU training experiments"),
    # The paper's from-scratch shapes (its section 4.1); key/value heads are not given, so full MHA.
    "1b": ModelConfig(dim=1536, n_layers=40, n_heads=24, n_kv_heads=24, ffn_hidden=4096,
                      vocab_size=49152, max_seq_len=2048, source="ladder paper 1.2B (FineWeb-edu)"),
    "3b": ModelConfig(dim=2304, n_layers=40, n_heads=36, n_kv_heads=36, ffn_hidden=9216,
                      vocab_size=49152, max_seq_len=2048, source="ladder paper 3.5B (FineWeb-edu)"),
    "llama-3-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                              vocab_size=128256, rope_theta=500000.0, max_seq_len=8192,
                              source="meta-llama/Meta-Llama-3-8B"),
    "llama-3.1-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                                vocab_size=128256, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
                                max_seq_len=131072, source="meta-llama/Llama-3.1-8B"),
    "codellama-34b": ModelConfig(dim=8192, n_layers=48, n_heads=64, n_kv_heads=8, ffn_hidden=22016,
                                 vocab_size=32000, rope_theta=1000000.0, max_seq_len=16384,
                                 source="codellama/CodeLlama-34b-hf"),
    "llama-3-70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                               vocab_size=128256, rope_theta=500000.0, max_seq_len=8192,
                               source="meta-llama/Meta-Llama-3-70B"),
    "llama-3.1-405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                                  vocab_size=128256, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
                                  max_seq_len=131072, source="meta-llama/Llama-3.1-405B"),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset called exactly `name`, with optional field overrides (e.g. layout)."""
    if name not in PRESETS:
        raise LadderError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


# ---- layouts compared side by side (bench and predict) ----------------------------------------------

def layout_variants(layouts: Sequence[str], ladder_layers: Sequence[int] | None) -> list[tuple[str, int | None]]:
    """(layout, N) to compare: ladder once per N of `ladder_layers` (hybrid; once, whole, without them),
    every other layout once, whole (N None): hybrids are compared with the same whole baselines."""
    check_hybrids(ladder_layers, layouts)
    return [(layout, n) for layout in layouts for n in (ladder_layers if layout == "ladder" and ladder_layers
                                                        else [None])]


def check_hybrids(ladder_layers: Sequence[int] | None, layouts: Sequence[str]) -> None:
    """`--ladder-layers` turns the ladder layout into hybrids: refuse it where there is no ladder to turn."""
    if ladder_layers is not None and "ladder" not in layouts:
        raise LadderError(f"--ladder-layers {','.join(map(str, ladder_layers))} makes the ladder layout hybrid, "
                          f"and --layouts {','.join(layouts)} has no ladder")
