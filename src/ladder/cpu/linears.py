"""Linear layers in the layout an eager CPU step reads fastest: plain weights packed once into oneDNN's
blocked layout, int8 weights on torch's int8 kernel.

`F.linear` on CPU calls MKL's sgemm, which re-reads the weight in its stored layout every call; oneDNN
reorders it once into the layout its kernels stream (vLLM's CPU backend does the same). A decode step
reads every weight once and computes little, so this is most of its time: SmolLM2's linear layers at
batch 8 took 83 ms with `F.linear` and 36 ms packed on a 2-core AVX2 EPYC (batch 1: 39 and 23 ms;
batch 64: 199 and 136 ms; experiments/investigations/packed_linear.py). Packed weights serve inference only: no gradients, no state_dict, and
a tied output head gets its own packed copy (the embedding keeps the original). A compiled step needs
plain weights (inductor lays them out itself): `weights_for_step` packs or unpacks a model, in place.

torchao's eager int8 linear casts the whole weight to the activations' dtype every call (the head's
49152 x 576 included, a transient as large as an unquantized head); `Int8RowLinear` calls torch's int8
kernel instead, the one a compiled step reaches through inductor's pattern, for bf16 and fp16 activations;
with fp32 ones that kernel is not vectorized (8.5x slower than bf16 here: 2 GB/s), and the weight is
dequantized a block of rows at a time instead. int4 keeps torchao's layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ladder.runtime.decode_step import DecodeStep
from ladder.model.transformer import HALF_PRECISION, Attention, FeedForward, Transformer, cpu_compute_dtype
from ladder.quant.quantize import is_int8_per_row, is_quantized, tensor_bytes

# Rows from which an int8 layer is faster dequantized (then one GEMM) than on torch's int8 kernel, which
# computes per row: measured with experiments/investigations/int8_eager.py.
INT8_DEQUANTIZE_MIN_ROWS = 64
DEQUANTIZE_ROWS = 4096  # output rows dequantized at a time: 9.4 MB of float32 for SmolLM2's 576 columns


class PackedLinear(nn.Module):
    """y = x W^T with W in oneDNN's layout (no bias: ladder's linears have none)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def unpacked(self) -> nn.Linear:
        """The plain layer again (oneDNN's reorder back is exact)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
        return linear


class Int8RowLinear(nn.Module):
    """torchao's int8 weight-only layer (one scale per output row) on CPU. Eager: half-precision decode rows
    on torch's int8 kernel; a prefill's many rows, and float32 activations (where that kernel is not
    vectorized), on the weight dequantized `DEQUANTIZE_ROWS` output rows at a time, each block one GEMM (the
    same products as torchao's eager layer, which dequantizes the whole weight each call: a float32 copy of
    SmolLM2's int8 head is 113 MB, its largest transient). Compiled: torchao's layer, which inductor's
    pattern turns into the int8 kernel. `layer` is the torchao layer it reads."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.layer(x)
        if x.dtype not in HALF_PRECISION or x.numel() >= INT8_DEQUANTIZE_MIN_ROWS * x.shape[-1]:
            return self._on_dequantized_rows(x)
        weight = self.layer.weight
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), weight.qdata,
                                               weight.scale.reshape(-1).to(x.dtype))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _on_dequantized_rows(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer.weight
        compute = cpu_compute_dtype(x.dtype)
        x_compute, scale = x.to(compute), weight.scale.reshape(-1, 1).to(compute)
        y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
        for start in range(0, weight.shape[0], DEQUANTIZE_ROWS):
            rows = slice(start, start + DEQUANTIZE_ROWS)
            y[..., rows] = F.linear(x_compute, weight.qdata[rows].to(compute).mul_(scale[rows]))
        return y


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build pack `dtype` weights: oneDNN is in every x86 and ARM build of
    torch, but bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and an AVX2 CPU refuses it."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        PackedLinear(nn.Linear(8, 8, bias=False, dtype=dtype))(torch.ones(1, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def weights_for_step(model: Transformer, step: DecodeStep) -> bool:
    """Put a CPU model's linear layers in the layouts its step reads fastest: plain ones packed for an
    eager step (plain again for a compiled one: inductor lays them out itself), int8 ones as
    `Int8RowLinear` in every step (a compiled step's eager prefill included). Whether the plain ones end
    packed (never on CUDA, nor where packing does not work)."""
    dtype = model.tok_embeddings.weight.dtype  # the activations'
    on_cpu = model.device.type == "cpu"
    pack = on_cpu and step is DecodeStep.EAGER and packing_works(dtype)
    was_packed = isinstance(model.output, PackedLinear)
    convert_linears(model, functools.partial(layer_for_step, pack=pack, int8_rows=on_cpu))
    if was_packed and not pack:
        model.tie_weights()
    return pack


def layer_for_step(layer: nn.Module, pack: bool, int8_rows: bool) -> nn.Module:
    if isinstance(layer, PackedLinear):
        return layer if pack else layer.unpacked()
    if isinstance(layer, Int8RowLinear):
        return layer if int8_rows else layer.layer
    if int8_rows and is_int8_per_row(layer.weight):
        return Int8RowLinear(layer)
    return PackedLinear(layer) if pack and not is_quantized(layer) else layer  # int4: torchao's kernel


def weight_bytes(model: Transformer) -> int:
    """The bytes of this rank's weights, packed or not, a tied head's table counted once (as plain)."""
    tensors = [*model.parameters(), *(m.packed for m in model.modules() if isinstance(m, PackedLinear))]
    total = sum(tensor_bytes(t) for t in tensors)
    if isinstance(model.output, PackedLinear) and model.config.tie_embeddings and not model.shard_vocab:
        total -= model.output.packed.numel() * model.output.packed.element_size()  # the table's packed copy
    return total


def convert_linears(model: Transformer, convert: Callable[[nn.Module], nn.Module]) -> None:
    """Replace each block linear and the head by `convert(layer)`."""
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.wqkv, module.wo = convert(module.wqkv), convert(module.wo)
        elif isinstance(module, FeedForward):
            module.w13, module.w2 = convert(module.w13), convert(module.w2)
    model.output = convert(model.output)
