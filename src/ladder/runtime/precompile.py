"""A compiled decode step that a later start loads whole, instead of tracing it again: torch's AOT compile
(`torch.compile(...).aot_compile`, `torch.compiler.load_compiled_function`; vLLM caches its compiled models
the same way). One file a step shape holds dynamo's bytecode, the step's guards and inductor's compiled
code, so a second start runs no dynamo trace and no cache lookups: SmolLM2 int8's step (GEMM templates)
loaded in 2.3 s, where torch's caches gave it back in 7.7-8.2 s (docs/compile.md).

The file's name is a digest of all a step's graph depends on and its guards do not check: torch, ladder,
the CPU's vector ISA, the model's config, every byte of its weights (constants of the graph, on a CPU
with GEMM templates), the engine's options and the step's shape. The guards it keeps (the inputs' and
the KV caches' shapes and dtypes) are checked at every call, and a file whose traced source has changed
since it was written is compiled again and replaced."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import ladder

SUFFIX = ".aot"


class SavedSteps:
    """`compiled` (torch.compile of `step(model, tokens, positions, kv_len=...)`, fullgraph) at each shape,
    loaded from `folder` where a file holds it, else compiled ahead of its first call and saved there.
    `key()` names what else the graph depends on (see the module's docstring), asked once, at the first call.
    A step's guards are checked at every call, as torch.compile checks them: one that fails (new KV caches
    of another shape) makes the step again."""

    def __init__(self, compiled: Any, model: torch.nn.Module, folder: Path, key: Callable[[], Sequence[str]]) -> None:
        self._compiled, self._model, self._folder = compiled, model, folder
        self._key_of, self._key = key, None
        self._shapes: dict[tuple[int, int], Any] = {}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        shape = (tokens.shape[0], kv_len)
        step = self._shapes.get(shape)
        if step is None or not step.guard_check(self._model, tokens, positions, kv_len=kv_len):
            step = self._shapes[shape] = self._load_or_compile(tokens, positions, kv_len)
        return step(self._model, tokens, positions, kv_len=kv_len)

    def path_of(self, batch: int, kv_len: int) -> Path:
        """The file of the step at this shape, over the model's buffers (its KV caches) as they are now."""
        self._key = self._key or list(self._key_of())
        buffers = [f"{name} {tuple(b.shape)} {b.dtype}" for name, b in self._model.named_buffers()]
        digest = hashlib.sha256("\n".join([*self._key, *buffers, f"batch {batch}", f"kv_len {kv_len}"]).encode())
        return self._folder / f"step-{digest.hexdigest()[:32]}{SUFFIX}"

    def _load_or_compile(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> Any:
        path = self.path_of(tokens.shape[0], kv_len)
        step = load_step(path)
        if step is not None and step.guard_check(self._model, tokens, positions, kv_len=kv_len):
            return step
        return compile_and_save(self._compiled, (self._model, tokens, positions), {"kv_len": kv_len}, path)


class SavedGraphs:
    """A function that runs at a few shapes (a layer's step: `ladder.runtime.compile.compile_layers`), compiled
    (`compiled`: torch.compile, fullgraph), each of its graphs saved to a file `NAME-*.aot` in `folder`.
    The first call loads every such file; a call runs the graph whose guards pass (the one that ran last is
    tried first), and a call that none takes is compiled ahead of time and saved."""

    def __init__(self, compiled: Any, folder: Path, name: str, dynamic_dims: Sequence[tuple[int, int]] = ()) -> None:
        self._compiled, self._folder, self._name = compiled, folder, name
        self._dynamic_dims = tuple(dynamic_dims)
        self._graphs: list[Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self._graphs is None:
            self._graphs = [graph for path in sorted(self._folder.glob(f"{self._name}-*{SUFFIX}"))
                            if (graph := load_step(path)) is not None]
        for i, graph in enumerate(self._graphs):
            if graph.guard_check(*args):
                if i:  # (a step's 61 calls mostly find the first: no list work on the hot path)
                    self._graphs.insert(0, self._graphs.pop(i))
                return graph(*args)
        graph = self._compile_and_save(args)
        self._graphs.insert(0, graph)
        return graph(*args)

    def _compile_and_save(self, args: tuple[Any, ...]) -> Any:
        """A graph for `args`, dynamic in `dynamic_dims`: marked on the arguments while it compiles only, as a
        loaded graph's guards take arguments without dynamo's marks."""
        marked = [args[i] for i, _ in self._dynamic_dims]
        for tensor, (_, dim) in zip(marked, self._dynamic_dims):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        try:
            return compile_and_save(self._compiled, args, {},
                                    self._folder / f"{self._name}-{signature_digest(args)}{SUFFIX}")
        finally:
            for tensor in marked:  # (the attributes `maybe_mark_dynamic` sets)
                for mark in ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking"):
                    tensor.__dict__.pop(mark, None)


class BoundGraphs:
    """`graphs` called with `owner` first: a saved step set as a layer's own method (`layer.mlp_step(...)`).
    torch saves a layer with the guards of a graph that takes it, and cannot save a callable of this kind:
    it is saved as nothing (a loaded graph gets its layer at each call)."""

    def __init__(self, graphs: SavedGraphs, owner: torch.nn.Module) -> None:
        self.graphs, self.owner = graphs, owner

    def __call__(self, *args: Any) -> Any:
        return self.graphs(self.owner, *args)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _nothing, ()


def _nothing() -> None:
    return None


def signature_digest(args: Sequence[Any]) -> str:
    """A digest of the arguments' kinds: each tensor's shape, strides and dtype, each module's class, the rest's repr."""
    def kind(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {value.stride()} {value.dtype}"
        return type(value).__name__ if isinstance(value, torch.nn.Module) else repr(value)
    leaves = torch.utils._pytree.tree_leaves(list(args))
    return hashlib.sha256("\n".join(map(kind, leaves)).encode()).hexdigest()[:32]


@contextlib.contextmanager
def no_autograd_cache_entries() -> Iterator[None]:
    """AOT compile writes the step to AOTAutograd's cache too, under a key no later start looks up (a step's
    own file holds the same code and constants: SmolLM2 int8's 131 MiB): what the block added there goes."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = Path(cache_dir()) / "aotautograd"
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        yield
    finally:
        for entry in set(folder.iterdir()) - before if folder.is_dir() else ():
            shutil.rmtree(entry, ignore_errors=True)


def compile_and_save(compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any], path: Path) -> Any:
    """`compiled` (torch.compile, fullgraph) compiled ahead of time for these arguments and saved to `path`;
    its guards are left to its caller, who checks them once a call."""
    with no_autograd_cache_entries():
        step = compiled.aot_compile((args, kwargs))
    step.disable_guard_check()
    save_step(step, path)
    return step


def load_step(path: Path) -> Any | None:
    """The step saved at `path`, or None: no such file, or one whose traced source has changed since."""
    try:
        with path.open("rb") as file, _vector_isa_trusted():
            step = torch.compiler.load_compiled_function(file)
    except FileNotFoundError:
        return None
    if not source_unchanged(step):
        return None
    step.disable_guard_check()  # (its caller checks them, once a call)
    return step


@contextlib.contextmanager
def _vector_isa_trusted() -> Iterator[None]:
    """inductor's kernels load without its probe of the CPU's vector ISA (a build, then a `dlopen` in a new
    interpreter): 0.7 s of a 7.9 s first answer from a saved int8 step on a 2-core EPYC. A saved step's file
    is named by this CPU's ISA flags (`cpu_vector_isa`), so a compile on a CPU of this kind built code for
    its ISA. inductor keeps the answer for the process: a later compile here takes it too. On AVX-512 and
    AMX it also builds a probe of each extension it would use (bf16, VNNI, AMX tiles) whatever `vec_isa_ok`
    says, once the CPU has reported the extension: those builds are trusted too, for the same reason (three
    probes on a 2-core AVX-512 BF16 EPYC)."""
    from torch._inductor import config, cpu_vec_isa

    probe = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = lambda isa, code: True  # type: ignore[method-assign]
    try:
        with config.patch({"cpp.vec_isa_ok": True}):
            yield
    finally:
        cpu_vec_isa.VecISA.check_build = probe  # type: ignore[method-assign]


def source_unchanged(step: Any) -> bool:
    """Whether every function dynamo traced into `step` reads as it did when the step was compiled."""
    from torch._dynamo.package import _hash_sourcelines

    for source in step.source_info().inlined_sources:
        module = sys.modules.get(source.module)
        if module is None or _hash_sourcelines(module, source.firstlineno, source.lastlineno) != source.checksum:
            return False
    return True


def save_step(step: Any, path: Path) -> None:
    """`step` written to `path` whole or not at all (another file first, then renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        step.save_compiled_function(str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def graph_key(model: torch.nn.Module, weights_digest: str, settings: object) -> list[str]:
    """What a compiled step's graph depends on beyond its guards (the module's docstring)."""
    config = getattr(model, "config", None)
    return [f"torch {torch.__version__}", f"ladder {ladder.__version__}", f"isa {cpu_vector_isa()}",
            f"config {config!r}", f"weights {weights_digest}", f"settings {settings!r}"]


def cpu_vector_isa() -> str:
    """The CPU's vector instruction sets that inductor picks its C++ code's from (`x86_isa_checker`'s flags)
    and the capability a user forced: read from the CPU, not by inductor's `pick_vec_isa`, which first
    builds a probe library with each and loads it in a new interpreter (`load_step`)."""
    cpu = torch.cpu
    avx512 = cpu._is_avx512_supported()
    flags = {"avx2": cpu._is_avx2_supported(), "avx512": avx512, "avx512_vnni": avx512 and cpu._is_vnni_supported(),
             "amx_tile": cpu._is_amx_tile_supported()}
    names = " ".join(name for name, supported in flags.items() if supported) or "none"
    return f"{platform.machine()} {names} ATEN_CPU_CAPABILITY={os.getenv('ATEN_CPU_CAPABILITY')}"


def aot_guard_filter(keep: Callable[[list[Any]], list[bool]]) -> Callable[[list[Any]], list[bool]]:
    """`keep`, less the guards torch cannot save: those on globals, and the kinds it does not serialize."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

    def saved_guards(guards: list[Any]) -> list[bool]:
        return [kept and not guard.is_global and guard.guard_type not in unsaved
                for kept, guard in zip(keep(guards), guards)]
    return saved_guards
