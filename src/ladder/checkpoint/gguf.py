"""GGUF files in: llama-architecture weights, dequantised on demand with the `gguf` package.

RoPE permutation: llama.cpp's converter permutes the rows of q_proj and k_proj within each head
(from Hugging Face's "rotate half" layout back to Meta's interleaved pairs). Our model, like
transformers, uses rotate-half, so `GGUFSource` applies the inverse permutation per head. It acts
within a head, so slicing whole heads before or after it gives the same rows.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ladder.checkpoint.base import Checkpoint, check_shapes
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.errors import LadderError
from ladder.model.config import ModelConfig, RopeScaling
from ladder.model.weights import ALL, Slice


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}



def _gguf() -> ModuleType:
    """The gguf package, imported when a GGUF file is read, not with ladder. Where mistral_common is
    installed (vLLM brings it) gguf imports it for Mistral's own tokenizer files, which ladder does not
    read: 0.9 s of every start-up. gguf imports it optionally, so it is hidden while gguf is imported."""
    if "gguf" in sys.modules:
        return sys.modules["gguf"]
    hide = "mistral_common" not in sys.modules
    if hide:
        sys.modules["mistral_common"] = None  # type: ignore[assignment]  (an import of it raises ImportError)
    try:
        import gguf
    finally:
        if hide:
            del sys.modules["mistral_common"]
    return gguf

def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


class GGUFSource:
    """Hugging Face-named tensors of a llama GGUF file, dequantised on demand."""

    def __init__(self, path: Path, reader: Any, config: ModelConfig) -> None:
        self.path, self.config = path, config
        self.tensors = {}
        supported = {_gguf().GGMLQuantizationType[n] for n in SUPPORTED_GGML_TYPES}
        for t in reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            if t.tensor_type not in supported:
                raise LadderError(f"{path.name}: tensor {t.name} uses quantisation {t.tensor_type.name}, which "
                                  f"ladder does not dequantise (supported: {', '.join(SUPPORTED_GGML_TYPES)})")
            self.tensors[name] = t

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape))  # GGUF lists dims fastest-first

    def get(self, name: str, index: Slice = ALL) -> torch.Tensor:
        t = self.tensors[name]
        rows, cols = index
        data = t.data
        # Quantisation blocks run along a row, so whole rows can be taken before dequantising.
        raw = data[rows] if data.ndim == 2 else data
        try:
            values = _gguf().quants.dequantize(np.ascontiguousarray(raw), t.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise LadderError(f"{self.path.name}: cannot dequantise {t.name}: {exc}") from None
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy of the mapped data
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.n_heads if "q_proj" in name else self.config.n_kv_heads
            start, stop, _ = rows.indices(heads * self.config.head_dim)
            tensor = _unpermute_rope_rows(tensor, (stop - start) // self.config.head_dim)
        return tensor[:, cols] if tensor.dim() == 2 else tensor


SUPPORTED_GGML_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                        "Q5_K", "Q6_K")


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation (interleaved pairs -> rotate-half halves)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def open_gguf(path: Path) -> Checkpoint:
    try:
        reader = _gguf().GGUFReader(path)
    except Exception as exc:  # the reader raises many types on truncated or corrupted files
        raise LadderError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise LadderError(f"{path.name}: architecture {arch!r} is not supported (ladder runs llama-architecture models)")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise LadderError(f"{path.name}: no token_embd.weight tensor (truncated or not a model file?)")
    dim = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    scaling = None
    if meta("rope.scaling.type") == "llama3" or _field(reader, "llama.rope.scaling.factor") is not None:
        scaling = RopeScaling(factor=float(meta("rope.scaling.factor", 8.0)),
                              original_max_position_embeddings=int(meta("rope.scaling.original_context_length", 8192)))
    try:
        config = ModelConfig(
            dim=dim, n_layers=int(meta("block_count")), n_heads=n_heads,
            n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
            ffn_hidden=int(meta("feed_forward_length")), vocab_size=int(embed.shape[-1]),
            rope_theta=float(meta("rope.freq_base", 10000.0)), rope_scaling=scaling,
            norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            max_seq_len=int(meta("context_length", 2048)), tie_embeddings="output.weight" not in names,
            source=str(_field(reader, "general.name", path.stem)))
    except (TypeError, ValueError) as exc:
        raise LadderError(f"{path.name}: incomplete llama metadata ({exc})") from None
    source = GGUFSource(path, reader, config)
    check_shapes(path.name, config, source)
    return Checkpoint(path, "gguf", config, source, TextTokenizer.from_gguf(reader, path.name))
