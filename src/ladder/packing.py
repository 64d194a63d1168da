"""Linear layers with their weights packed once into oneDNN's blocked layout, for inference on CPU.

`F.linear` on CPU calls MKL's sgemm, which re-reads the weight in its stored layout every call; oneDNN
reorders it once into the layout its kernels stream (vLLM's CPU backend does the same). A decode step
reads every weight once and computes little, so this is most of its time: SmolLM2's linear layers at
batch 8 took 83 ms with `F.linear` and 36 ms packed on a 2-core AVX2 EPYC (batch 1: 39 and 23 ms;
batch 64: 199 and 136 ms; experiments/investigations/packed_linear.py). Packed weights serve inference only: no gradients, no state_dict, and
a tied output head gets its own packed copy (the embedding keeps the original). A compiled step needs
plain weights (inductor lays them out itself): `weights_for_step` packs or unpacks a model, in place.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ladder.decode_step import DecodeStep
from ladder.model import Attention, FeedForward, Transformer
from ladder.quantize import is_quantized, tensor_bytes


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
    """Pack a CPU model's linear layers for an eager step, unpack them for a compiled one; whether they
    end packed (never on CUDA, nor where packing does not work)."""
    packed = isinstance(model.output, PackedLinear)
    wanted = step is DecodeStep.EAGER and model.device.type == "cpu" and packing_works(model.tok_embeddings.weight.dtype)
    if packed != wanted:
        _convert_linears(model, PackedLinear if wanted else PackedLinear.unpacked)
        if not wanted:
            model.tie_weights()
    return wanted


def weight_bytes(model: Transformer) -> int:
    """The bytes of this rank's weights, packed or not, a tied head's table counted once (as plain)."""
    tensors = [*model.parameters(), *(m.packed for m in model.modules() if isinstance(m, PackedLinear))]
    total = sum(tensor_bytes(t) for t in tensors)
    if isinstance(model.output, PackedLinear) and model.config.tie_embeddings and not model.shard_vocab:
        total -= model.output.packed.numel() * model.output.packed.element_size()  # the table's packed copy
    return total


def _unless_quantized(convert, linear: nn.Module) -> nn.Module:
    return linear if is_quantized(linear) else convert(linear)


def _convert_linears(model: Transformer, convert) -> None:
    """Convert every plain linear layer (quantized ones keep torchao's layout and kernels)."""
    convert = functools.partial(_unless_quantized, convert)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.wqkv, module.wo = convert(module.wqkv), convert(module.wo)
        elif isinstance(module, FeedForward):
            module.w13, module.w2 = convert(module.w13), convert(module.w2)
    model.output = convert(model.output)
