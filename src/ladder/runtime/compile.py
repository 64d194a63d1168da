"""A decode step compiled as one graph (`--compile`): inductor's settings for it, its guards, and its
frozen weights on a CPU. (`--compile-layers` compiles each layer instead: `Transformer.compile_layers`.)"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ladder.comm.emulated import trace_emulated_launches
from ladder.cpu.inductor_fix import keep_mutation_renames
from ladder.options import RuntimeOptions

# A compiled CPU step freezes the weights (constants of the graph) so that inductor can pick its C++ GEMM
# templates: weights repacked once into blocks, the int8 dequantization and scale fused into the GEMM.
# SmolLM2 at batch 1 on an AVX2 CPU (docs/quantization.md): int8 bf16 twice as fast as torch's
# `_weight_int8pack_mm` kernel, fp32 twice as fast as oneDNN's GEMV. The compile takes longer (each GEMM
# shape's template and ATen kernel are built and timed): `RuntimeOptions.cpu_gemm_templates` (False:
# LADDER_CPU_GEMM_TEMPLATES=0) keeps inductor's defaults.
# (inductor reads `freezing` outside a compile's options: `_with_frozen_weights` sets it.)
CPU_GEMM_TEMPLATES = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def compile_step(step: Callable[..., torch.Tensor], device: torch.device,
                 options: RuntimeOptions) -> Callable[..., torch.Tensor]:
    """`step` as one torch.compile graph (collectives, real or emulated, trace into it), as in the paper,
    with CUDA graphs on CUDA (mode="reduce-overhead"). reorder_for_locality would move each all-reduce
    launch down to its wait, and the overlap with it. Each wait is a custom op that writes its result:
    `keep_mutation_renames` keeps inductor's CPU fusion from reading that result before the wait."""
    templates = device.type == "cpu" and options.cpu_gemm_templates
    inductor = {"triton.cudagraphs": device.type == "cuda", "reorder_for_locality": False,
                **(CPU_GEMM_TEMPLATES if templates else {}), **options.inductor_options}
    trace_emulated_launches()
    keep_mutation_renames()
    # Entries of its own (torch.compile shares them among every compile of one function), so that the
    # guards on the model can go: they would be checked each step, and this engine's model never changes.
    compiled = torch.compile(step, fullgraph=True, options={**inductor, "guard_filter_fn": guards_off_the_model},
                             isolate_recompiles=True)
    return _with_frozen_weights(compiled) if templates else compiled


def guards_off_the_model(guards: list[Any]) -> list[bool]:
    """Which of a compiled step's guards to keep: all but those on the model, whose weights, modules and
    settings stay as they are for an engine's life (its compiled step is its own: `isolate_recompiles`),
    except its buffers' shapes (`setup_caches` makes new KV caches). Checking SmolLM2's 6,000 guards
    took 1.8 ms of a 16 ms int8 step on this CPU."""
    return [not guard.orig_guard.source.is_unspecialized_nn_module()
            or (guard.guard_type == "TENSOR_MATCH" and "._buffers[" in guard.name) for guard in guards]


def _with_frozen_weights(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`compiled`, compiling (at its first call, and at each recompile) with the weights frozen: an engine
    serves fixed weights, and the prefill, eager, reads the model's own. Not through inductor's on-disk
    graph cache, so each compile starts cold (SmolLM2 int8: ~140 s; bf16 ~35 s from the cache): it keys
    frozen weights by their shapes, and a hit gave a second model of one shape the first one's weights
    (tests/test_engine.py). With a digest of the weights in its key (tried), each entry still wrote the
    weights the graph packed to disk, once for every shape a step is made at (SmolLM2: 137 MB int8, 271 MB
    bf16 an entry)."""
    import torch._inductor.config as inductor_config

    @functools.wraps(compiled)
    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        with inductor_config.patch(freezing=True, fx_graph_cache=False):
            return compiled(*args, **kwargs)
    return step
