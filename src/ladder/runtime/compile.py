"""A decode step compiled as one graph (`--compile`): inductor's settings for it, its guards, and its
frozen weights on a CPU. (`--compile-layers` compiles each layer instead: `Transformer.compile_layers`.)"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ladder.comm.emulated import trace_emulated_launches
from ladder.cpu.inductor_fix import keep_mutation_renames
from ladder.model.config import cpu_computes_in_bf16
from ladder.model.transformer import KVCache
from ladder.options import CPU_GEMM_TEMPLATES as TEMPLATES_VARIABLE, RuntimeOptions, cache_root

INDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"

# A compiled CPU step can freeze the weights (constants of the graph) so that inductor can pick its C++ GEMM
# templates: weights repacked once into blocks, the int8 dequantization and scale fused into the GEMM.
# SmolLM2 at batch 1 on an AVX2 CPU (docs/quantization.md): int8 bf16 45-52 tokens/s against 37 on torch's
# `_weight_int8pack_mm` kernel, fp32 twice as fast as oneDNN's GEMV. A frozen step cannot come whole from
# torch's caches (AOTAutograd's refuses freezing): a later start compiles for 20-50 s, where an unfrozen
# step is read back in 6 s. On a CPU with bf16 arithmetic the templates are not measured (the runs there
# had them switched off by `cpp.weight_prepack`, see `_with_frozen_weights`), so they are on by default
# only where bf16 arithmetic is missing (`uses_gemm_templates`).
# (inductor reads `freezing` outside a compile's options: `_with_frozen_weights` sets it.)
CPU_GEMM_TEMPLATES = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def use_compile_cache() -> None:
    """Where torch.compile keeps what a later start reads instead of compiling again (inductor's FX graph
    cache, AOTAutograd's, its autotuning results and built kernels): `TORCHINDUCTOR_CACHE_DIR` where the
    user set it, else `inductor/` in ladder's cache folder (set for this process, before its first
    compile); torch's default folder when the user turned ladder's cache off."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE_DIR)  # (importing inductor sets it to its default: not a choice)
    root = cache_root()
    if root is not None and (not chosen or Path(chosen).resolve() == Path(default_cache_dir()).resolve()):
        os.environ[INDUCTOR_CACHE_DIR] = str(root / "inductor")


def compile_step(step: Callable[..., torch.Tensor], device: torch.device, options: RuntimeOptions,
                 model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`step` as one torch.compile graph (collectives, real or emulated, trace into it), as in the paper,
    with CUDA graphs on CUDA (mode="reduce-overhead"). reorder_for_locality would move each all-reduce
    launch down to its wait, and the overlap with it. Each wait is a custom op that writes its result:
    `keep_mutation_renames` keeps inductor's CPU fusion from reading that result before the wait."""
    templates = uses_gemm_templates(options, device)
    inductor = {"triton.cudagraphs": device.type == "cuda", "reorder_for_locality": False,
                **(CPU_GEMM_TEMPLATES if templates else {}), **options.inductor_options}
    trace_emulated_launches()
    keep_mutation_renames()
    # Entries of its own (torch.compile shares them among every compile of one function), so that the
    # guards on the model can go: they would be checked each step, and this engine's model never changes.
    compiled = torch.compile(step, fullgraph=True, options={**inductor, "guard_filter_fn": guards_off_the_model},
                             isolate_recompiles=True)
    return _with_frozen_weights(compiled, model) if templates else compiled


def uses_gemm_templates(options: RuntimeOptions, device: torch.device) -> bool:
    """Whether a compiled step freezes its weights into inductor's C++ GEMM templates: on a CPU, where the
    user says so (`LADDER_CPU_GEMM_TEMPLATES`), else where the CPU has no bf16 arithmetic (the comment above)."""
    if device.type != "cpu":
        return False
    return options.cpu_gemm_templates if options.cpu_gemm_templates is not None else not cpu_computes_in_bf16()


def frozen_step_note() -> str:
    """What a start-up line says of a step whose weights are frozen (`Engine.freezes_weights`)."""
    return (f"its weights frozen into inductor's GEMM templates, which torch's caches cannot hold whole: it "
            f"compiles again at every start ({TEMPLATES_VARIABLE}=0 or --compile-layers: a slower step that a "
            "later start reads from the cache)")


def guards_off_the_model(guards: list[Any]) -> list[bool]:
    """Which of a compiled step's guards to keep: all but those on the model, whose weights, modules and
    settings stay as they are for an engine's life (its compiled step is its own: `isolate_recompiles`),
    except its buffers' shapes (`setup_caches` makes new KV caches). Checking SmolLM2's 6,000 guards
    took 1.8 ms of a 16 ms int8 step on this CPU."""
    return [not guard.orig_guard.source.is_unspecialized_nn_module()
            or (guard.guard_type == "TENSOR_MATCH" and "._buffers[" in guard.name) for guard in guards]


def _with_frozen_weights(compiled: Callable[..., torch.Tensor], model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`compiled`, compiling (at its first call, and at each recompile) with `model`'s weights frozen: an
    engine serves fixed weights, and the prefill, eager, reads the model's own.

    Inductor's FX graph cache keys frozen weights by their shapes: a hit gave a second model of one shape
    the first one's weights (tests/test_engine.py). So a digest of every byte of the weights goes into the
    key (torch's `cache_key_tag`), and a later start with the same weights reads the graph; other weights
    compile their own. `cpp.weight_prepack` stays on: inductor offers its GEMM templates only with it
    (`use_cpp_gemm_template`). With it off (from 102f339 until this was found), every int8 GEMM ran
    torch's kernel: SmolLM2 int8 at 37.4 tokens/s on a 2-core AVX2 EPYC, 45.1 with the templates (a later
    start, from the cache, took 51 s either way). With ladder's cache off, nothing is written."""
    import torch._inductor.config as inductor_config

    settings: dict[str, Any] = {}  # fixed at the first call (an engine built and not run digests nothing)

    @functools.wraps(compiled)
    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not settings:
            cached = cache_root() is not None
            settings.update(inductor={"freezing": True, "fx_graph_cache": cached},
                            tag=f"ladder-weights-{weights_digest(model)}" if cached else "")
        with inductor_config.patch(settings["inductor"]), torch.compiler.config.patch(cache_key_tag=settings["tag"]):
            return compiled(*args, **kwargs)
    return step


@torch.no_grad()
def weights_digest(model: torch.nn.Module) -> str:
    """A digest of every byte of a model's weights: its parameters and buffers (quantized tensors by their
    parts), not its KV caches. SmolLM2 in float32 (540 MB): about half a second here."""
    caches = {id(b) for m in model.modules() if isinstance(m, KVCache) for b in m.buffers()}
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if id(tensor) in caches:
            continue
        for part in _plain_parts(tensor):
            digest.update(f"{name}:{part.dtype}:{tuple(part.shape)}".encode())
            digest.update(part.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _plain_parts(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A tensor, or the plain tensors a tensor subclass (torchao's quantized weights) is made of."""
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        yield from _plain_parts(getattr(tensor, name))
