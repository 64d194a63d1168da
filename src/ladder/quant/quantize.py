"""Weight-only int8 and int4 quantization of each rank's shard, through torchao's `quantize_`.

Applied to each rank's shard, each block as soon as it is loaded (`ModelSpec.load`): the four linear
layers of every block (fused QKV, attention output, fused gate/up, down), and with int8 the output head.
A rank quantizes exactly the weights it multiplies, so quantization composes with every layout, TP
degree and link. The embedding and the norms stay in the model's dtype (a tied head gets its own
quantized copy; the embedding only gathers rows).

- int8: per-output-row symmetric scales (`Int8WeightOnlyConfig`), CPU and CUDA. The head too, as gpt-fast
  quantizes it: SmolLM2's tied head is a fifth of its weights, and int8 there moved held-out perplexity
  by under 0.7 % while a compiled batch-1 step went from 21.3 to 19.6 ms (docs/quantization.md). int4
  keeps the head unquantized: there it cost 7-15 % of perplexity.
- int4: groups of `INT4_GROUP` input columns, asymmetric, on torch's tinygemm kernels: the CPU one
  (torchao's `Int4OpaqueTensor`, which `PrototypeInt4WeightOnlyConfig` makes, built here a chunk of rows at
  a time; `_weight_int4pack_mm_for_cpu`) and the CUDA one (`Int4WeightOnlyConfig` in the tile-packed layout,
  bf16 only). Group 32 is llama.cpp's Q4 block, and divides every shard width
  of the checkpoints ladder is used with (SmolLM2 at TP 1 to 3, Llama-3 8B and 70B at TP 1 to 8).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import warnings
from typing import Any

import torch
from torch import nn

from ladder.errors import LadderError
from ladder.model.transformer import Transformer

QUANTIZE_MODES = ("int8", "int4")
INT4_GROUP = 32
# Quantized this many rows at a time: an int8 head (float32 temporaries of 2.4 MB for SmolLM2), a CPU int4
# linear (int32 ones of 2.4 MB for SmolLM2's gate/up, 7.1 MB whole).
CHUNK_ROWS = 1024
# `_convert_weight_to_int4pack_for_cpu` interleaves rows in blocks of 64 where ATen's kernels use AVX-512 and
# of 32 with AVX2: chunks of a multiple of the larger split neither.
INT4_CPU_PACKED_ROWS = 64
INSTALL_HINT = 'pip install "ladder[quantize]"  (torchao)'


def bytes_per_weight(mode: str | None, dtype_bytes: int, row_width: int | None = None) -> float:
    """Bytes a decode step reads per block-linear weight, scales included, for a model in a dtype of
    `dtype_bytes`: int8 keeps a float32 scale and an int8 zero point per output row of `row_width` weights
    (None: rows so wide that they do not count); int4 keeps a scale and a zero point per group of
    INT4_GROUP, in the model's dtype (bf16: 4 / 32 = 0.125 bytes a weight)."""
    if mode is None:
        return dtype_bytes
    if mode == "int8":
        return 1.0 + (5 / row_width if row_width else 0.0)
    return 0.5 + 2 * dtype_bytes / INT4_GROUP


def check_quantize(mode: str | None, device_type: str, dtype: torch.dtype) -> None:
    """Refuse, in one line, a mode or combination that torchao cannot run here; before any weights load."""
    if mode is None:
        return
    if mode not in QUANTIZE_MODES:
        raise LadderError(f"--quantize {mode!r}: give one of {', '.join(QUANTIZE_MODES)}")
    if importlib.util.find_spec("torchao") is None:  # not imported here: 3.5 s, which the ranks that quantize pay
        raise LadderError(f"--quantize needs torchao (not installed): {INSTALL_HINT}")
    if mode == "int4" and device_type == "cuda" and dtype != torch.bfloat16:
        raise LadderError(f"--quantize int4 on CUDA runs torchao's tinygemm kernel, which takes bfloat16 "
                          f"activations only: add --dtype bfloat16 (asked: {str(dtype).removeprefix('torch.')})")
    if mode == "int4" and device_type == "cpu" and not _int4_cpu_kernel_runs(dtype):
        raise LadderError(f"--quantize int4 on CPU needs torch's _weight_int4pack_mm_for_cpu kernel for "
                          f"{str(dtype).removeprefix('torch.')}, which this torch build lacks")


def quantize_shard(model: Transformer, mode: str | None) -> None:
    """Quantize this rank's block linears (and int8's head) in place, those not quantized yet (nothing
    when `mode` is None)."""
    if mode is None:
        return
    check_shard(model, mode)
    quantize_layers(model, mode)


def check_shard(model: Transformer, mode: str) -> None:
    """Refuse in one line a shard that `mode` cannot quantize here; its blocks may still be on the meta
    device (`build_model(blocks_later=True)`)."""
    check_quantize(mode, model.device.type, model.tok_embeddings.weight.dtype)
    if mode == "int4":
        _check_groups(model)


def quantize_layers(module: nn.Module, mode: str) -> None:
    """Quantize the layers of `module` (a shard, or one block as it is loaded) that `mode` quantizes and
    that are not quantized yet, in place."""
    ao = _torchao()
    device_type = next(module.parameters()).device.type
    head = getattr(module, "output", None)
    with torch.no_grad():
        if quantizes_head(mode) and isinstance(head, nn.Linear) and not is_quantized(head):
            head.weight = nn.Parameter(int8_in_row_chunks(ao, head.weight), requires_grad=False)
        if mode == "int4" and device_type == "cpu":
            for name, linear in module.named_modules():
                if _is_unquantized_block_linear(linear, name):
                    linear.weight = nn.Parameter(int4_in_row_chunks(ao, linear.weight), requires_grad=False)
        else:
            ao.quantize_(module, _config(ao, mode), filter_fn=_is_unquantized_block_linear)


def int8_in_row_chunks(ao: Any, weight: torch.Tensor, rows: int = CHUNK_ROWS) -> torch.Tensor:
    """torchao's per-row int8 of `weight`, `rows` rows at a time: the same tensor as quantizing it whole
    (each row has its own scale), without float32 temporaries of the whole table. For a head, those
    were twice its size: a quantized SmolLM2 peaked at 2x its final bytes while loading."""
    qdata = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)  # filled in place: no int8 copy either
    scales, zero_points, block_size = [], [], None
    for i in range(0, weight.shape[0], rows):
        part = ao.Int8Tensor.from_hp(weight[i:i + rows].detach(), ao.PerRow())
        qdata[i:i + rows] = part.qdata
        scales.append(part.scale)
        zero_points.append(part.zero_point)
        block_size = part.block_size
    return ao.Int8Tensor(qdata, torch.cat(scales), block_size, weight.dtype,
                         zero_point=None if zero_points[0] is None else torch.cat(zero_points))


def int4_in_row_chunks(ao: Any, weight: torch.Tensor, rows: int = CHUNK_ROWS) -> torch.Tensor:
    """torchao's CPU int4 of `weight` (`PrototypeInt4WeightOnlyConfig`'s tensor), `rows` rows at a time:
    the same tensor as quantizing it whole (groups run along a row, the kernel packs rows in blocks of
    INT4_CPU_PACKED_ROWS, and the scales' row axis concatenates), without its int32 and bf16 temporaries
    of the whole weight, which set a quantized SmolLM2's peak while loading (1.08 of `ladder.runtime.memory`'s
    estimate)."""
    if rows % INT4_CPU_PACKED_ROWS:
        raise ValueError(f"int4 chunks of {rows} rows would split the kernel's blocks of {INT4_CPU_PACKED_ROWS}")
    parts = [ao.Int4OpaqueTensor.from_hp(weight[i:i + rows].detach(), [1, INT4_GROUP])
             for i in range(0, weight.shape[0], rows)]
    return ao.Int4OpaqueTensor(qdata=torch.cat([p.qdata for p in parts]),
                               scale_and_zero=torch.cat([p.scale_and_zero for p in parts], dim=1),
                               block_size=[1, INT4_GROUP], shape=weight.shape, act_pre_scale=None)


def is_quantized(linear: nn.Module) -> bool:
    """Whether a linear layer's weight is one of torchao's quantized tensors (not a plain tensor)."""
    weight = getattr(linear, "weight", None)
    return weight is not None and type(weight) not in (torch.Tensor, nn.Parameter)


def is_int8_per_row(weight: torch.Tensor) -> bool:
    """torchao's int8 weight-only tensor with one scale per output row (`Int8WeightOnlyConfig`), read by
    its attributes: ladder imports torchao only where quantization is asked for."""
    qdata = getattr(weight, "qdata", None)
    return (qdata is not None and qdata.dtype == torch.int8 and getattr(weight, "act_quant_kwargs", True) is None
            and getattr(weight, "act_pre_scale", None) is None and list(weight.block_size) == [1, qdata.shape[-1]])


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: a quantized tensor's are its inner tensors' (data, scales, zero points),
    not its logical shape times the dtype it computes in."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return t.numel() * t.element_size()
    inner_names, _ = t.__tensor_flatten__()
    return sum(tensor_bytes(getattr(t, name)) for name in inner_names)


def quantizes_head(mode: str | None) -> bool:
    """Whether `mode` quantizes the output head as well as the block linears (int8 only)."""
    return mode == "int8"


def block_linears(model: Transformer) -> list[tuple[str, nn.Linear]]:
    """Each block's four linear layers (QKV, attention output, gate/up, down), as (name, layer)."""
    return [(name, m) for name, m in model.named_modules() if _is_block_linear(m, name)]


def _is_block_linear(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in ("wqkv", "wo", "w13", "w2")


def _is_unquantized_block_linear(module: nn.Module, name: str) -> bool:
    return _is_block_linear(module, name) and not is_quantized(module)


def _check_groups(model: Transformer) -> None:
    for name, linear in block_linears(model):
        if linear.in_features % INT4_GROUP:
            raise LadderError(f"--quantize int4 groups {INT4_GROUP} input columns, and {name} has "
                              f"{linear.in_features} on this rank (tp={model.comm.world_size})")


def _config(ao: Any, mode: str) -> Any:
    """`quantize_`'s configuration (CPU int4 does not go through it: `int4_in_row_chunks`)."""
    if mode == "int8":
        return ao.Int8WeightOnlyConfig()
    return ao.Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d")


@functools.cache
def _int4_cpu_kernel_runs(dtype: torch.dtype) -> bool:
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), 1)
        scales = torch.ones(64 // INT4_GROUP, 16, 2, dtype=dtype)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.ones(1, 64, dtype=dtype), packed, INT4_GROUP, scales)
    except (RuntimeError, AttributeError):
        return False
    return True


class _Torchao:
    """The parts of torchao ladder uses, imported once."""

    def __init__(self) -> None:
        with _quiet_import():
            from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
            from torchao.quantization import Int4WeightOnlyConfig, Int8Tensor, Int8WeightOnlyConfig, PerRow, quantize_
        self.quantize_ = quantize_
        self.Int8Tensor, self.PerRow = Int8Tensor, PerRow
        # torch.compile warns once per compiled step that torchao's tensors cannot key its on-disk cache:
        # they then compile again each run, which the warning cannot help a user with.
        warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching")
        self.Int8WeightOnlyConfig = Int8WeightOnlyConfig
        self.Int4WeightOnlyConfig = Int4WeightOnlyConfig
        self.Int4OpaqueTensor = Int4OpaqueTensor


@functools.cache
def _torchao() -> _Torchao:
    try:
        return _Torchao()
    except ImportError as exc:
        raise LadderError(f"--quantize needs torchao ({exc}): {INSTALL_HINT}") from None


@contextlib.contextmanager
def _quiet_import():
    """torchao's import warns about each optional kernel library built for a GPU this machine lacks
    (mxfp8, CUTLASS sm90a), and torch about an Enum torchao registers: noise to a user who asked for
    int8. Silenced for the import only."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
