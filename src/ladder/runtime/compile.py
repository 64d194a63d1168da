"""A decode step compiled as one graph (`--compile`): inductor's settings for it, its guards, and its
weights as constants of the graph on a CPU; `--compile-layers` compiles each layer instead (`compile_layers`)."""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import itertools
import os
import threading
import unittest.mock
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ladder.comm.emulated import EmulatedCommunicator, trace_emulated_launches
from ladder.cpu.inductor_fix import keep_mutation_renames
from ladder.cpu.linears import HandleLinear
from ladder.model.transformer import MASK_CACHE_DIM, Block, KVCache, Transformer
from ladder.options import RuntimeOptions, cache_root
from ladder.runtime.precompile import BoundGraphs, SavedGraphs, SavedSteps, aot_guard_filter, graph_key

INDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"

# A compiled CPU step can take the weights as constants of its graph so that inductor can pick its C++ GEMM
# templates: weights repacked once into blocks, the int8 dequantization and scale fused into the GEMM.
# SmolLM2 at batch 1 on an AVX2 CPU (docs/quantization.md): int8 bf16 45-58 tokens/s against 34-37 on
# torch's `_weight_int8pack_mm` kernel, fp32 twice as fast as oneDNN's GEMV. inductor's own way there,
# freezing, keeps a graph out of AOTAutograd's cache, so a later start traced and froze again for 46-52 s;
# `_weights_as_constants` makes the constants itself and the whole step comes back from torch's caches.
# On a 2-core AVX-512 BF16 EPYC (results/compile_cache/avx512-bf16.md) the templates decoded int8 at 111
# tokens/s against 48, bf16 at 67 against 47 (by handle), for a longer first compile (124 s against 69, int8) and a
# cache entry that holds the packed weights (136 MiB int8, 521 bf16); a second start printed its first
# token in 9.0 s (int8; 13.7-17.3 bf16). So they are on for a compiled CPU step on every CPU kind
# (`uses_gemm_templates`), except a server's (`ladder.serve.worker.serving_options`).
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


def compile_step(step: Callable[..., torch.Tensor], model: Transformer, device: torch.device,
                 options: RuntimeOptions) -> Callable[..., torch.Tensor]:
    """`step(model, tokens, positions, kv_len=...)` as one torch.compile graph (collectives, real or
    emulated, trace into it), as in the paper, with CUDA graphs on CUDA (mode="reduce-overhead"); on a CPU
    with ladder's cache, saved whole for a later start (`ladder.runtime.precompile`). Returns
    `(tokens, positions, kv_len=...) -> logits`. reorder_for_locality would move each all-reduce launch
    down to its wait, and the overlap with it. Each wait is a custom op that writes its result:
    `keep_mutation_renames` keeps inductor's CPU fusion from reading that result before the wait."""
    templates = uses_gemm_templates(options, device)
    inductor = {"triton.cudagraphs": device.type == "cuda", "reorder_for_locality": False,
                **(CPU_GEMM_TEMPLATES if templates else {}), **options.inductor_options}
    trace_emulated_launches()
    keep_mutation_renames()
    # Dynamo traces each layer's modules once, as compile regions (`ladder.model.transformer.compile_region`),
    # and hands on one flat graph: GEMM templates need the weights as constants of the graph inductor compiles,
    # not inputs of a subgraph, and inductor's caches then hold what they held before. (Only ladder's
    # regions are marked in its processes.)
    torch._dynamo.config.inline_invoke_subgraph = True
    saved = saves_steps(model, device)  # (in the inductor cache folder `use_compile_cache` chose)
    # Hashed on another thread (hashlib lets go of the GIL) while dynamo traces the step: SmolLM2's 0.4 s.
    keyed = saved or templates and cache_root() is not None
    digest = _in_background(_digest, _named_weights(model)) if keyed else None
    # Entries of its own (torch.compile shares them among every compile of one function), so that the
    # guards on the model can go: they would be checked each step, and this engine's model never changes.
    guards = aot_guard_filter(guards_off_the_model) if saved else guards_off_the_model
    # A graph of its own for each shape (dynamic=False: a shape that differs from the first does not turn
    # the batch symbolic), as each shape's templates and CUDA graph want, and as stamping out regions needs.
    backend = _weights_as_constants(model, inductor, digest) if templates else "inductor"
    settings = {"guard_filter_fn": guards, **({} if templates else inductor)}
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend, options=settings,
                             isolate_recompiles=True)
    if saved:
        return SavedSteps(compiled, model, Path(os.environ[INDUCTOR_CACHE_DIR]) / "ladder-steps",
                          lambda: graph_key(model, digest.result(), (options, inductor, comm_key(model.comm))))
    return functools.partial(compiled, model)


def compile_layers(model: Transformer, inductor_options: Mapping[str, Any] | None = None,
                   saved: Callable[..., Callable[[torch.nn.Module], Callable[..., Any]]] | None = None) -> None:
    """Regional compilation, in place (an engine compiles its own view: `Transformer.view`): torch.compile each layer's steps (residual add + norm +
    attention and residual add + norm + MLP, or parallel's pair under one norm), not the whole forward.
    Every layer runs the same code with its own weights as inputs, so all layers reuse one compiled
    graph per step and input shape: compiling 80 layers costs what compiling one does (a compiled
    forward grows with the layers). The all-reduces and their waits stay eager, so every layout keeps
    its eager schedule: ladder's all-reduces overlap the next step. The final norm and head are compiled
    too: an int8 head runs torchao's int8 kernel only compiled (eager, it casts the whole table).
    A prefill, of many lengths, runs on another view that is not compiled. The cache length is dynamic
    (`Transformer._layers` marks the mask's): attention compiles twice a batch size (below the whole cache, and
    the whole cache), not once a cache length, which a second start would trace again (docs/compile.md).
    `saved(name, function, dynamic (argument, dim) pairs)`: each step compiled and saved for a later
    start instead, bound to each layer (`ladder.runtime.compile.saved_layer_steps`)."""
    model.layers_compiled = True
    if saved is not None:  # one function a step, which each layer calls with itself
        model.layers_saved = True
        for name in Block.STEPS:
            bind = saved(name, getattr(Block, name), ((5, MASK_CACHE_DIM),) if name in Block.MASKED else ())
            for layer in model.layers:
                setattr(layer, name, bind(layer))
        model.head = saved("head", Transformer.head, ())(model)
        return
    options = dict(inductor_options or {}) or None
    for layer in model.layers:
        for name in Block.STEPS:
            step = getattr(Block, name).__get__(layer)  # the method itself, even if compiled before
            dynamic = None if name in Block.MASKED else False  # MLP: static, as the head
            setattr(layer, name, torch.compile(step, fullgraph=True, dynamic=dynamic, options=options))
    model.head = torch.compile(Transformer.head.__get__(model), fullgraph=True, dynamic=False, options=options)


def saved_layer_steps(model: Transformer, device: torch.device, options: RuntimeOptions) -> Callable[..., Any] | None:
    """How `compile_layers` compiles a layer step (or the head) and saves its graphs for a later
    start (`ladder.runtime.precompile.SavedGraphs`), in a folder named by what they depend on beyond their
    guards (the weights are inputs: their names, kinds and shapes); None where steps are not saved."""
    if not saves_layer_steps(model, device, options):
        return None
    weights = [f"{name} {type(p).__name__} {p.dtype} {tuple(p.shape)}" for name, p in model.named_parameters()]
    key = graph_key(model, hashlib.sha256("\n".join(weights).encode()).hexdigest(), (options, comm_key(model.comm)))
    folder = (Path(os.environ[INDUCTOR_CACHE_DIR]) / "ladder-layers"
              / hashlib.sha256("\n".join(key).encode()).hexdigest()[:32])
    settings = {**options.inductor_options, "guard_filter_fn": aot_guard_filter(lambda guards: [True] * len(guards))}

    def saved(name: str, function: Callable[..., Any], dynamic_dims: tuple[tuple[int, int], ...]) -> Callable[..., Any]:
        compiled = torch.compile(function, fullgraph=True, dynamic=None if dynamic_dims else False, options=settings)
        return functools.partial(BoundGraphs, SavedGraphs(compiled, folder, name, dynamic_dims))
    return saved


def saves_layer_steps(model: Transformer, device: torch.device, options: RuntimeOptions) -> bool:
    """Whether compiled layers are saved: where a whole step is, but with flex attention (its compile needs
    dynamo's tracing context, which AOT compile does not give it)."""
    return saves_steps(model, device) and options.decode_attention_on(device.type) != "flex"


def saves_steps(model: Transformer, device: torch.device) -> bool:
    """Whether a compiled step is saved for a later start: on a CPU (CUDA graphs are captured at each
    start), with ladder's cache on, and collectives that are a real group's or none (an emulated link's
    ops name their communicator by a number of this process)."""
    return device.type == "cpu" and cache_root() is not None and not isinstance(model.comm, EmulatedCommunicator)


def comm_key(comm: Any) -> str:
    """The collectives a step's graph names: its group, and this rank's place in it."""
    return f"{type(comm).__name__} rank {comm.rank} of {comm.world_size} {getattr(comm, 'group_name', '')}"


def uses_gemm_templates(options: RuntimeOptions, device: torch.device) -> bool:
    """Whether a compiled step takes its weights as constants, packed into inductor's C++ GEMM templates: on
    a CPU, unless the user says otherwise (`LADDER_CPU_GEMM_TEMPLATES`; the comment above)."""
    if device.type != "cpu":
        return False
    return options.cpu_gemm_templates is not False  # None: the default


def guards_off_the_model(guards: list[Any]) -> list[bool]:
    """Which of a compiled step's guards to keep: all but those on the model, whose weights, modules and
    settings stay as they are for an engine's life (its compiled step is its own: `isolate_recompiles`),
    except its buffers' shapes (`setup_caches` makes new KV caches). Checking SmolLM2's 6,000 guards
    took 1.8 ms of a 16 ms int8 step on this CPU."""
    return [not guard.orig_guard.source.is_unspecialized_nn_module()
            or (guard.guard_type == "TENSOR_MATCH" and "._buffers[" in guard.name) for guard in guards]


def _weights_as_constants(model: Transformer, inductor: dict[str, Any],
                          digest: concurrent.futures.Future[str] | None) -> Callable[..., Any]:
    """A torch.compile backend: inductor, `inductor` its settings, with `model`'s parameters as constants of
    the graph (an engine serves fixed weights; the prefill, eager, reads the model's own) so that its GEMM
    templates can pack them. inductor's freezing would do this, but AOTAutograd's cache refuses a frozen
    graph; constants of the graph it holds, and a later start reads the whole step back.

    inductor's caches key constants like these by their shapes only: a hit gave a second model of one shape
    the first one's weights (tests/test_engine.py). So a digest of every byte of the weights goes into the
    key (torch's `cache_key_tag`), and a later start with the same weights reads the graph; other weights
    compile their own. With ladder's cache off (`digest` None), nothing is written."""
    from torch._inductor.compile_fx import compile_fx

    constants = _constant_parameters(model)
    cached = digest is not None

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        _inputs_as_constants(graph, example_inputs, constants)
        fake_mode = torch._guards.TracingContext.get().fake_mode  # the constants are real tensors
        with torch.compiler.config.patch(cache_key_tag=f"ladder-weights-{digest.result()}" if digest else ""), \
                unittest.mock.patch.object(fake_mode, "allow_non_fake_inputs", True):
            return compile_fx(graph, example_inputs, config_patches={**inductor, "fx_graph_cache": cached})
    return backend


def _in_background(fn: Callable[..., str], *args: Any) -> concurrent.futures.Future[str]:
    """fn(*args) on a daemon thread: a process that ends meanwhile (an error, Ctrl-C) does not wait for it."""
    future: concurrent.futures.Future[str] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # the compile that waits for it raises it
            future.set_exception(exc)
    threading.Thread(target=run, name="ladder-weights-digest", daemon=True).start()
    return future


def _constant_parameters(model: Transformer) -> set[int]:
    """The ids of the tensors a step takes as constants: the model's plain parameters (its linear layers',
    its norms'), not the embedding table unless the head reads it too (a table only looked up gains nothing
    and would be copied into every cache entry), nor tensor subclasses, nor buffers (the KV caches change)."""
    table, head = model.tok_embeddings.weight, {id(p) for p in model.output.parameters()}
    return {id(p) for p in model.parameters()
            if not is_traceable_wrapper_subclass(p) and (p is not table or id(p) in head)}


def _inputs_as_constants(graph: torch.fx.GraphModule, example_inputs: list[Any], constants: set[int]) -> None:
    """Make dynamo's graph, in place, read its inputs among `constants` from attributes (`get_attr`), each
    marked as inductor marks a frozen parameter (its cache key reads the shape, not every value: the digest
    covers them). Their placeholders stay, unread: dynamo passes an input for each placeholder it finds
    (and a copy of its graph cost 0.7 s of SmolLM2's start)."""
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    for i, (node, value) in reversed(list(enumerate(zip(placeholders, example_inputs)))):
        if id(value) not in constants:
            continue
        name = f"ladder_constant_{i}"
        tensor = value.detach()
        tensor._is_frozen_param = True
        setattr(graph, name, tensor)  # a plain attribute: AOTAutograd lifts parameters and buffers to inputs
        with graph.graph.inserting_after(placeholders[-1]):  # after every placeholder, in their order
            attribute = graph.graph.create_node("get_attr", name)
        attribute.meta.update(node.meta)
        node.replace_all_uses_with(attribute)
    graph.recompile()


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of every byte of a model's weights: its parameters and buffers (quantized tensors by their
    parts), not its KV caches. SmolLM2 in float32 (540 MB): about half a second here."""
    return _digest(_named_weights(model))


def _named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A model's parameters and buffers, but its KV caches and the handles of packed weights (numbers of this
    process; the graph reads the weights they name as it runs), by name (read here: `_digest` may run on
    another thread while this one changes the model's buffers)."""
    caches = {id(b) for m in model.modules() if isinstance(m, (KVCache, HandleLinear)) for b in m.buffers()}
    return [(name, tensor) for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
            if id(tensor) not in caches]


@torch.no_grad()
def _digest(named: list[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named:
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
