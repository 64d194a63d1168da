"""LoRA adapters through PEFT (`trainable=lora`): low-rank updates W + (alpha / r) B A on the block linears
of the chosen layers, the rest of the model frozen.

PEFT wraps each target linear in place (`inject_adapter_in_model`); the model's code calls the wrapper
as it called the linear. A checkpoint stays a plain model: its weights are the adapters merged in (any
ladder command, and transformers, load it as they load any checkpoint), and the adapters themselves go
beside them (`adapters.safetensors`) so that `--resume` continues from the same base and adapters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ladder.errors import LadderError
from ladder.model.transformer import Transformer

TARGETS = ["wqkv", "wo", "w13", "w2"]  # every block linear (fused QKV and gate/up, as ladder holds them)
ADAPTERS_FILE = "adapters.safetensors"
_BASE, _A, _B = ".base_layer.weight", ".lora_A.default.weight", ".lora_B.default.weight"


def add_lora(model: Transformer, layers: list[int], rank: int, alpha: float) -> int:
    """Adapters on `layers`' block linears; everything else frozen. Returns the trainable parameter count."""
    try:
        from peft import LoraConfig, inject_adapter_in_model  # (imported here: an optional dependency)
    except ImportError:
        raise LadderError("trainable=lora needs PEFT: pip install peft") from None
    if not layers:
        raise LadderError("trainable=lora with lora_layers=converted needs a ladder conversion (set ladder_layers), "
                          "or lora_layers=all")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS,
                        layers_to_transform=layers, layers_pattern="layers")
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad = ".lora_" in name
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def has_lora(params: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith(_BASE) for name in params)


def merged(params: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The model's parameters under its own names, each adapted linear as W + scaling * B A (whole tensors:
    gathered from FSDP shards first)."""
    out = {}
    for name, tensor in params.items():
        if ".lora_" in name:
            continue
        if name.endswith(_BASE):
            stem = name.removesuffix(_BASE)
            tensor = tensor + scaling * (params[stem + _B].float() @ params[stem + _A].float()).to(tensor.dtype)
            name = stem + ".weight"
        out[name] = tensor
    return out


def adapters(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().contiguous() for name, t in params.items() if ".lora_" in name}


def save_adapters(params: dict[str, torch.Tensor], folder: Path) -> None:
    save_file(adapters(params), str(folder / ADAPTERS_FILE))


@torch.no_grad()
def load_adapters(model: Transformer, folder: Path) -> None:
    path = folder / ADAPTERS_FILE
    if not path.is_file():
        raise LadderError(f"{folder} has no {ADAPTERS_FILE}: it was not written by a trainable=lora run")
    saved = load_file(str(path))
    own = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    if set(saved) != set(own):
        raise LadderError(f"{path} holds adapters for other layers or targets than this run's")
    for name, p in own.items():
        p.copy_(saved[name])
