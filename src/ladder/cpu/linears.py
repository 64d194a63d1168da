"""Linear layers in the forms a CPU computes fastest: plain weights packed once into oneDNN's blocked
layout, int8 weights on torch's int8 kernel, half-precision weights upcast where the CPU has no bf16
arithmetic. An engine puts the layers of its own views of a model in these forms (`linear_forms`).

`F.linear` on CPU calls MKL's sgemm, which re-reads the weight in its stored layout every call; oneDNN
reorders it once into the layout its kernels stream (vLLM's CPU backend does the same). A decode step
reads every weight once and computes little, so this is most of its time: SmolLM2's linear layers at
batch 8 took 83 ms with `F.linear` and 36 ms packed on a 2-core AVX2 EPYC (batch 1: 39 and 23 ms;
batch 64: 199 and 136 ms; experiments/investigations/packed_linear.py). Packed weights serve inference only: no gradients, no state_dict, and
a tied output head gets its own packed copy (the embedding keeps the original). A compiled step reaches
the same packed weights through an op of ladder's (`HandleLinear`), unless its weights are constants of
its graph for inductor's GEMM templates.

torchao's eager int8 linear casts the whole weight to the activations' dtype every call (the head's
49152 x 576 included, a transient as large as an unquantized head); `Int8RowLinear` calls torch's int8
kernel instead, the one a compiled step reaches through inductor's pattern, for bf16 and fp16 activations;
with fp32 ones that kernel is not vectorized (8.5x slower than bf16 here: 2 GB/s), and the weight is
dequantized a block of rows at a time instead. int4 keeps torchao's layer, and so does a compiled step,
where inductor's pattern turns torchao's int8 layer into that kernel, unless the step's weights are
constants of its graph (`Int8MatmulLinear`).

PyTorch has no bf16 matrix kernel for AVX2, so on such a CPU each row of a bf16 linear is one more pass
over the weight, while an upcast weight is read once more than the half one: `UpcastLinear` multiplies
in float32 from UPCAST_MIN_ROWS rows.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ladder.model.transformer import HALF_PRECISION, Attention, FeedForward, Transformer
from ladder.quant.quantize import is_int8_per_row, is_quantized, tensor_bytes

# Rows from which an int8 layer is faster dequantized (then one GEMM) than on torch's int8 kernel, which
# computes per row: measured with experiments/investigations/int8_eager.py.
INT8_DEQUANTIZE_MIN_ROWS = 64
DEQUANTIZE_ROWS = 4096  # output rows dequantized at a time: 9.4 MB of float32 for SmolLM2's 576 columns
# Rows from which a half-precision linear layer multiplies faster in float32 on a CPU without bf16
# arithmetic: SmolLM2's bf16 decode step on a 2-core AVX2 EPYC took 73 ms at batch 4 with bf16 linears and
# 81-93 upcast (the upcast reads and writes every weight again), 135 and 102-111 at batch 8; its 8 x
# 64-token prefill 5.6 s and 0.82 s (experiments/investigations/bf16_upcast.py).
UPCAST_MIN_ROWS = 8


Packs = dict[int, torch.Tensor]
"""Weights packed for an engine's views, by the id of the plain weight: its eager and its compiled view
share one packed copy."""


def packed_weight(linear: nn.Linear, packs: Packs | None = None) -> torch.Tensor:
    """`linear`'s weight in oneDNN's layout: the one in `packs`, or packed now (and kept there)."""
    if packs is not None and id(linear.weight) in packs:
        return packs[id(linear.weight)]
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
    if packs is not None:
        packs[id(linear.weight)] = packed
    return packed


class PackedLinear(nn.Module):
    """y = x W^T with W in oneDNN's layout (no bias: ladder's linears have none)."""

    def __init__(self, linear: nn.Linear, packs: Packs | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", packed_weight(linear, packs), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def unpacked(self) -> nn.Linear:
        """The plain layer again (oneDNN's reorder back is exact)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
        return linear


# `ladder::packed_linear(x, handle, out_features)`: x times the packed weight `handle` names, in a compiled
# step. inductor's own oneDNN linear takes a packed weight only as a constant of its graph (freezing), which
# its caches then hold, a copy for each shape; found by a handle, the weight stays out of the graph: a
# server's shapes share one packed copy, and a cache entry holds code only, never a model's weights. In
# SmolLM2's bf16 step at batch 8 (2-core Xeon with AMX), 33-35 ms, against 62-66 eager and 250 compiled
# on plain weights (inductor's extern bf16 GEMM reorders the weight every call).
_PACKED: dict[int, torch.Tensor] = {}
_handles = itertools.count()
_library = torch.library.Library("ladder", "FRAGMENT")
# Defined with torch.library's lower-level API: a `custom_op`'s Python wrappers cost 77 us a call, this 9.
_library.define("packed_linear(Tensor x, Tensor handle, SymInt out_features) -> Tensor")


def _packed_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[int(handle)], None, "none", [], "")


_library.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("ladder::packed_linear")
def _packed_linear_shape(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class HandleLinear(nn.Module):
    """`PackedLinear` for a compiled step: its packed weight reached by a handle (a one-number buffer)
    through `ladder::packed_linear`, so that the graph holds no weight. The weight lives while the handle
    does (a view of the model shares it: `Transformer.view`)."""

    def __init__(self, linear: nn.Linear, packs: Packs | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        handle = next(_handles)
        _PACKED[handle] = packed_weight(linear, packs)
        self.register_buffer("handle", torch.tensor(handle), persistent=False)
        weakref.finalize(self.handle, _PACKED.pop, handle, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ladder.packed_linear(x, self.handle, self.out_features)

    @property
    def packed(self) -> torch.Tensor:
        return _PACKED[int(self.handle)]


class UpcastLinear(nn.Module):
    """A half-precision layer that multiplies in float32 from UPCAST_MIN_ROWS rows (a CPU without bf16
    arithmetic: see the module's docstring); `layer` is the layer it reads."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= UPCAST_MIN_ROWS * x.shape[-1]:
            return F.linear(x.float(), self.layer.weight.float()).to(x.dtype)
        return self.layer(x)


class Int8RowLinear(nn.Module):
    """torchao's int8 weight-only layer (one scale per output row) in an eager CPU forward: half-precision
    decode rows on torch's int8 kernel; a prefill's many rows, and float32 activations (where that kernel is
    not vectorized), on the weight dequantized `DEQUANTIZE_ROWS` output rows at a time, each block one GEMM
    in `compute_dtype` (the same products as torchao's eager layer, which dequantizes the whole weight each
    call: a float32 copy of SmolLM2's int8 head is 113 MB, its largest transient). `layer` is the torchao
    layer it reads."""

    def __init__(self, layer: nn.Linear, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layer, self.compute_dtype = layer, compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in HALF_PRECISION or x.numel() >= INT8_DEQUANTIZE_MIN_ROWS * x.shape[-1]:
            return self._on_dequantized_rows(x)
        weight = self.layer.weight
        return int8_matmul(x, weight.qdata, weight.scale.reshape(-1).to(x.dtype))

    def _on_dequantized_rows(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer.weight
        compute = self.compute_dtype or x.dtype
        x_compute, scale = x.to(compute), weight.scale.reshape(-1, 1).to(compute)
        y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
        for start in range(0, weight.shape[0], DEQUANTIZE_ROWS):
            rows = slice(start, start + DEQUANTIZE_ROWS)
            y[..., rows] = F.linear(x_compute, weight.qdata[rows].to(compute).mul_(scale[rows]))
        return y


class Int8MatmulLinear(nn.Module):
    """torchao's int8 weight-only layer as the plain tensors torch's int8 kernel takes, for a compiled step
    whose weights are constants of its graph (`ladder.runtime.compile`): inductor packs a constant int8
    weight into its C++ GEMM template; a tensor subclass stays an input of the graph, on torch's kernel.
    `dtype`: the activations' (the kernel's scales are in it). The int8 rows are the torchao layer's own."""

    def __init__(self, layer: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        weight = layer.weight
        self.qdata = nn.Parameter(weight.qdata.detach(), requires_grad=False)
        self.scale = nn.Parameter(weight.scale.detach().reshape(-1).to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.qdata, self.scale)


def int8_matmul(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., in) times the int8 rows `qdata` (out, in), each times its `scale` (out,) in x's dtype: torch's
    int8 kernel, which takes x as rows."""
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), qdata, scale)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dequantized(layer: nn.Linear) -> nn.Linear:
    """An int8 layer's weight in float32, for a compiled step with float32 activations and constant
    weights: inductor's float32 GEMM template on it decoded SmolLM2 at 27.9 tokens/s on a 2-core AVX2 EPYC,
    the int8 kernel (`Int8MatmulLinear`) at 10.6 (inductor's freezing used to fold the dequantization
    into the constants the same way: 27.4)."""
    linear = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(layer.weight.dequantize().float(), requires_grad=False)  # torchao's own
    return linear


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


def linear_forms(view: Transformer, pack: bool, int8_rows: bool, upcast: bool, int8_matmul: bool = False,
                 by_handle: bool = False, packs: Packs | None = None) -> None:
    """Put a view's linear layers (`Transformer.view`: its layers are its own) in the forms its forwards
    compute fastest: plain ones packed (`pack`: an eager CPU forward; `by_handle`: a compiled CPU step whose
    weights are not constants, `HandleLinear`; neither where packing does not work), int8
    ones as `Int8RowLinear` (`int8_rows`: an eager CPU forward) or `Int8MatmulLinear` (`int8_matmul`: a
    compiled step with constant weights), plain half-precision ones not packed as `UpcastLinear` (`upcast`:
    a CPU without bf16 arithmetic). Views given one `packs` share their packed weights."""
    dtype = view.tok_embeddings.weight.dtype  # the activations'
    works = packing_works(dtype)
    compute = torch.float32 if upcast and dtype in HALF_PRECISION else None
    form = functools.partial(linear_form, pack=pack and works, by_handle=by_handle and works, int8_rows=int8_rows,
                             compute_dtype=compute, int8_matmul=dtype if int8_matmul else None, packs=packs)
    convert_linears(view, form)


def linear_form(layer: nn.Module, pack: bool, int8_rows: bool, compute_dtype: torch.dtype | None,
                int8_matmul: torch.dtype | None = None, by_handle: bool = False,
                packs: Packs | None = None) -> nn.Module:
    if int8_rows and is_int8_per_row(layer.weight):
        return Int8RowLinear(layer, compute_dtype)
    if int8_matmul is not None and is_int8_per_row(layer.weight):
        return Int8MatmulLinear(layer, int8_matmul) if int8_matmul in HALF_PRECISION else dequantized(layer)
    if is_quantized(layer):
        return layer  # int4, and int8 in a compiled step: torchao's kernels
    if pack:
        return PackedLinear(layer, packs)
    if by_handle:
        return HandleLinear(layer, packs)
    return UpcastLinear(layer) if compute_dtype is not None and layer.weight.dtype in HALF_PRECISION else layer


def weight_bytes(model: Transformer) -> int:
    """The bytes of this rank's weights, packed or not, each packed copy once, a tied head's table counted
    once (as plain)."""
    packed = {id(m.packed): m.packed for m in model.modules() if isinstance(m, (PackedLinear, HandleLinear))}
    total = sum(tensor_bytes(t) for t in [*model.parameters(), *packed.values()])
    if isinstance(model.output, (PackedLinear, HandleLinear)) and model.config.tie_embeddings and not model.shard_vocab:
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
