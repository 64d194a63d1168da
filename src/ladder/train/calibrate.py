"""Calibration of a ladder conversion: each converted module's stale input, corrected in closed form.

A converted module reads the residual stream one module stale, without the output of the module just
before it (`layouts.md`). Before any training, `calibrate_stale_inputs` fits, for each converted module
in execution order, the linear map M that best turns the module's normed stale input into the normed
input the original model gives that module at the same position: least squares over the calibration
tokens, with a small ridge towards the identity. M folds into the module's first projection (W <- W M:
attention's fused QKV, the MLP's fused gate and up), so the model keeps its shapes, layout and speed.
Each fit sees the stream that the modules before it, already corrected, give.

It costs a forward of the calibration tokens through each model and one dim x dim solve per module.
On SmolLM2-135M with ladder on its last 8 of 30 layers, 16,384 tokens take held-out perplexity from
+42 % over the original's to +7 %, before any training (results/distillation.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladder.errors import LadderError
from ladder.model.transformer import Transformer

RIDGE = 1e-3  # of the mean diagonal of the inputs' Gram matrix: keeps M near the identity where data is thin


@dataclass(frozen=True)
class ModuleFit:
    """One converted module's calibration: the relative squared error of its normed input against the
    original model's, |x - x_original|^2 / |x_original|^2 over the calibration tokens, before and after."""
    layer: int
    module: str  # attention or mlp
    error_before: float
    error_after: float


def converted_modules(model: Transformer, first: int) -> list[tuple[int, str, torch.nn.Module, torch.nn.Linear]]:
    """(layer, name, module, its first projection) of each module of layers first.., in execution order."""
    out = []
    for i in range(first, model.config.n_layers):
        layer = model.layers[i]
        out += [(i, "attention", layer.attention, layer.attention.wqkv), (i, "mlp", layer.feed_forward,
                                                                            layer.feed_forward.w13)]
    return out


def check_calibratable(student: Transformer, original: Transformer) -> None:
    if student.config.layout != "ladder" or student.config.n_ladder_layers == 0:
        raise LadderError("calibration corrects a ladder conversion's stale inputs: it needs ladder_layers "
                          f"(this model is {student.config.layout_name})")
    if original.config.layout != "standard":
        raise LadderError(f"calibration needs the original model in the standard layout, not {original.config.layout_name}")
    if (original.config.n_layers, original.config.dim) != (student.config.n_layers, student.config.dim):
        raise LadderError(f"calibration needs the model the conversion came from: {original.config.n_layers} layers "
                          f"of width {original.config.dim}, against the converted {student.config.n_layers} of "
                          f"{student.config.dim}")
    for _, name, _, linear in converted_modules(student, student.config.first_ladder_layer):
        if type(linear) is not torch.nn.Linear or not linear.weight.is_floating_point():
            raise LadderError(f"calibration folds into plain float weights; the {name} projection is "
                              f"{type(linear).__name__}: calibrate before quantizing or adding adapters")


@torch.no_grad()
def calibrate_stale_inputs(student: Transformer, original: Transformer, tokens: torch.Tensor) -> list[ModuleFit]:
    """Correct `student`'s converted modules in place (see the module's docstring) on tokens (B, T), all in
    one forward of each model (TP 1); the original is the checkpoint the student was converted from."""
    check_calibratable(student, original)
    if tokens.numel() < 4 * student.config.dim:
        raise LadderError(f"calibration fits a {student.config.dim} x {student.config.dim} map per module: give it at "
                          f"least {4 * student.config.dim} tokens, not {tokens.numel()}")
    first = student.config.first_ladder_layer
    targets: list[torch.Tensor] = []
    handles = [module.register_forward_pre_hook(lambda module, args: targets.append(args[0].flatten(0, -2).float()))
               for _, _, module, _ in converted_modules(original, first)]
    try:
        original.stream_before(tokens, original.config.n_layers)
    finally:
        for handle in handles:
            handle.remove()
    fits: list[ModuleFit] = []
    modules = converted_modules(student, first)
    handles = [module.register_forward_pre_hook(_fit_and_fold(layer, name, linear, targets, index, fits))
               for index, (layer, name, module, linear) in enumerate(modules)]
    try:
        student.stream_before(tokens, student.config.n_layers)
    finally:
        for handle in handles:
            handle.remove()
    return fits


def _fit_and_fold(layer: int, name: str, linear: torch.nn.Linear, targets: list[torch.Tensor], index: int,
                  fits: list[ModuleFit]) -> Callable[[torch.nn.Module, tuple], None]:
    """A pre-hook that fits the module's input map on what it is about to read, and folds it in first."""
    def hook(module: torch.nn.Module, args: tuple) -> None:
        stale, wanted = args[0].flatten(0, -2).double(), targets[index].double()  # (tokens, dim)
        gram = stale.T @ stale
        ridge = RIDGE * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        m = torch.linalg.solve(gram + ridge, stale.T @ wanted + ridge)  # stale @ m ~ wanted, (dim, dim)
        norm = wanted.square().sum()
        fits.append(ModuleFit(layer, name, float((stale - wanted).square().sum() / norm),
                              float((stale @ m - wanted).square().sum() / norm)))
        linear.weight.copy_((linear.weight.double() @ m.T).to(linear.weight.dtype))
    return hook


def describe(fits: list[ModuleFit]) -> str:
    """One line: the mean input error before and after, over the calibrated modules."""
    before = sum(f.error_before for f in fits) / len(fits)
    after = sum(f.error_after for f in fits) / len(fits)
    return (f"calibrated {len(fits)} converted modules: their inputs' relative error to the original's "
            f"{before:.3f} -> {after:.3f} (mean)")
