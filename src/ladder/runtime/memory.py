"""How much memory one rank needs, estimated before anything is built: `ladder bench` refuses what
cannot fit before launching, and `ladder predict` marks the rows that could not run."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ladder.cpu.linears import DEQUANTIZE_ROWS
from ladder.errors import LadderError
from ladder.model.config import ModelConfig, ShardShape
from ladder.options import DecodeStep, RuntimeOptions
from ladder.quant.quantize import bytes_per_weight, quantizes_head
from ladder.runtime.compile import uses_gemm_templates

MEMORY_USABLE = 0.9  # of a device's memory; the rest is the allocator's, CUDA's and the graphs' own


def estimate_memory_bytes(config: ModelConfig, tp: int, batch: int, prompt_len: int, seq: int, dtype_bytes: int,
                          models: int = 1, weight_sets: int = 1, quantize: str | None = None,
                          cpu_step: DecodeStep | None = None) -> int:
    """One rank's weights (shared by the `models` models: one set, unless `weight_sets` says otherwise),
    the KV cache and rope tables of each model, and the largest activation (one model runs at a time: the prefill's),
    in bytes, for rank 0 (which holds the most heads when they do not divide evenly); on CPU (`cpu_step`, the
    decode step), what the step's layers add (`cpu_step_bytes`). tests/test_bench.py holds it to the peaks
    measured on an H100, experiments/quantization.py to SmolLM2's on CPU."""
    shard = ShardShape.of(config, 0, tp)
    kv_cache = kv_cache_bytes(config, shard.n_kv_heads, batch, seq, 1)
    # The prefill of one layer: its inputs, norms and outputs (dim wide), the MLP's gate, up and product
    # (ffn / tp wide), and the attention scores in case SDPA takes its math path; then the logits of the
    # last position only (in float32).
    tokens = batch * prompt_len
    activations = (tokens * (4 * config.dim + 3 * shard.ffn_hidden)
                   + batch * shard.n_heads * prompt_len * seq
                   + batch * config.vocab_size * 4 // dtype_bytes)
    weights = weight_set_bytes(config, tp, dtype_bytes, quantize)
    rope_tables = 2 * seq * config.head_dim * 4  # cos and sin of every cache position, float32
    step = 0 if cpu_step is None else cpu_step_bytes(config, tp, dtype_bytes, quantize, cpu_step)
    return int(weight_sets * weights + (models * kv_cache + activations) * dtype_bytes + models * rope_tables + step)


def cpu_step_bytes(config: ModelConfig, tp: int, dtype_bytes: int, quantize: str | None, step: DecodeStep) -> int:
    """What a CPU engine's layers hold beyond the weights: an int8 layer dequantizes a prefill's weight
    `DEQUANTIZE_ROWS` output rows at a time, in float32 (`ladder.cpu.linears.Int8RowLinear`). A compiled step with
    constant weights (`ladder.runtime.compile.compile_step`) packs each linear weight that inductor's GEMM templates
    take (all but int4's: no AVX2 template) into a blocked copy of its own, beside the one the eager prefill
    reads, and holds one more copy of the largest while it packs it. Measured on SmolLM2 (docs/quantization.md):
    int8's packed copies 135 MB; int4's head (bf16) 56.6 MB kept, 56.6 more at the peak. Unquantized, the
    templates take only the shapes where they time faster than ATen: an upper bound there."""
    block = block_linear_shapes(config, tp)
    head = (config.vocab_size, config.dim)
    dequantized = 0
    if quantize == "int8":
        dequantized = max(min(rows, DEQUANTIZE_ROWS) * columns for rows, columns in [*block, head]) * 4
    options = RuntimeOptions.from_environment(step)
    packs = step is DecodeStep.COMPILED and uses_gemm_templates(options, torch.device("cpu"))
    if not packs:
        return dequantized
    quantized_bytes = bytes_per_weight(quantize, dtype_bytes, row_width=config.dim)
    packed = [] if quantize == "int4" else [rows * columns * quantized_bytes for rows, columns in block]
    packed *= config.n_layers
    packed.append(head[0] * head[1] * (quantized_bytes if quantizes_head(quantize) else dtype_bytes))
    return int(dequantized + sum(packed) + max(packed))


def weight_set_bytes(config: ModelConfig, tp: int, dtype_bytes: int, quantize: str | None = None) -> float:
    """One rank's weights: the block linears split by `tp` (quantized, when asked, at their bytes per
    weight with scales), the vocabulary tables whole on every rank: the embedding in the model's dtype,
    the head too unless `quantize` quantizes it (a tied head then gets a quantized copy of its own)."""
    table = config.vocab_size * config.dim
    linears = block_linear_params(config)
    rest = config.n_params() - linears - table * (1 if config.tie_embeddings else 2)  # the norms
    per_weight = bytes_per_weight(quantize, dtype_bytes, row_width=config.dim)  # most rows are dim wide
    if quantizes_head(quantize):
        vocab_tables = table * (dtype_bytes + per_weight)
    else:
        vocab_tables = table * dtype_bytes * (1 if config.tie_embeddings else 2)
    return (linears * per_weight + rest * dtype_bytes) / tp + vocab_tables


def block_linear_params(config: ModelConfig) -> int:
    """The weights of every block's linear layers (QKV, attention output, gate/up, down): what
    `--quantize` quantizes."""
    return config.n_layers * sum(rows * columns for rows, columns in block_linear_shapes(config, 1))


def block_linear_shapes(config: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(rows, columns) of one block's four linear layers (QKV, attention output, gate/up, down) on rank 0."""
    shard = ShardShape.of(config, 0, tp)
    q_dim, kv_dim = shard.n_heads * config.head_dim, shard.n_kv_heads * config.head_dim
    return [(q_dim + 2 * kv_dim, config.dim), (config.dim, q_dim), (2 * shard.ffn_hidden, config.dim),
            (config.dim, shard.ffn_hidden)]


def kv_cache_bytes(config: ModelConfig, kv_heads: int, batch: int, positions: int, dtype_bytes: int,
                   layers: int | None = None) -> int:
    """Keys and values of `kv_heads` heads, `batch` sequences of `positions` each, in `layers` layers
    (default: all of the model's)."""
    return 2 * (config.n_layers if layers is None else layers) * batch * kv_heads * positions * config.head_dim * dtype_bytes


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fits_in(need_bytes: int, device_bytes: int) -> bool:
    """Whether a rank needing `need_bytes` (`estimate_memory_bytes`) fits a device of `device_bytes`."""
    return need_bytes <= MEMORY_USABLE * device_bytes


def memory_available_now(device: torch.device) -> int:
    """Memory a new allocation can take now: the kernel's MemAvailable on CPU (free plus reclaimable
    page cache), the driver's free memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory_setting(text: str) -> float | int:
    """`--kv-cache-memory`: a fraction in (0, 1) of the memory available, or a size: 4GiB, 512MB, 1e9."""
    number = text.strip().lower().rstrip("ibgmk")
    unit = text.strip().lower()[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0 or (unit == "" and value >= 1 and value != int(value)):
        raise LadderError(f"--kv-cache-memory {text!r}: give a fraction of the free memory (0.2) or a size "
                          "(4GiB, 512MB)")
    return value if unit == "" and value < 1 else int(value * _UNITS[unit])


@dataclass(frozen=True)
class KvCachePlan:
    """A server's KV cache: `rows` sequences of `max_model_len` positions, within a byte budget."""

    rows: int
    max_model_len: int
    bytes: int
    budget_bytes: int

    def describe(self) -> str:
        return (f"KV cache {size_text(self.bytes)} of a {size_text(self.budget_bytes)} budget: {self.rows} rows of "
                f"{self.max_model_len} positions")


def size_text(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def plan_kv_cache(config: ModelConfig, tp: int, dtype_bytes: int, budget_bytes: int, max_batch: int,
                  max_model_len: int | None) -> KvCachePlan:
    """Rows and context that fit `budget_bytes` (rank 0's shard holds the most KV heads). Without a
    `max_model_len`, the context is what fits `max_batch` rows, up to the model's, in whole blocks of 64;
    with one, the rows are what fit, up to `max_batch`. Refuses in one line, naming the numbers, when not
    even one sequence fits."""
    per_position = kv_cache_bytes(config, ShardShape.of(config, 0, tp).n_kv_heads, 1, 1, dtype_bytes)
    positions = budget_bytes // per_position
    if max_model_len is None:
        fits = positions // max_batch
        length = min(config.max_seq_len, fits - fits % 64 if fits >= 64 else fits)
        rows = max_batch
    else:
        length, rows = max_model_len, min(max_batch, positions // max_model_len)
    if length < 2 or rows < 1:
        asked = length if max_model_len is not None else 2
        raise LadderError(f"the KV cache budget of {size_text(budget_bytes)} (--kv-cache-memory) holds {positions} "
                          f"positions at {per_position} bytes each; one sequence of {asked} positions needs "
                          f"{size_text(asked * per_position)}: raise --kv-cache-memory or lower --max-model-len")
    return KvCachePlan(rows, length, rows * length * per_position, budget_bytes)


def peak_cpu_bytes(run: Callable[[], Any]) -> tuple[int, Any]:
    """The peak of torch's CPU tensor bytes allocated while `run()` runs, above those live before it,
    and what it returned: from the profiler's allocation and free events (CUDA has
    `torch.cuda.max_memory_allocated`; a CPU process's resident size also counts the allocator's cache
    and mapped files). Slow on big runs: every allocation is recorded."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = run()
    changes = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n_bytes in changes:
        live += n_bytes
        peak = max(peak, live)
    return peak, result
