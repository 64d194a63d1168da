"""Every setting that is not a model: one typed object for how an engine runs (`RuntimeOptions`), filled
from the command line's step flags (`DecodeStep.from_flags`) and the environment here, and the table of
every `LADDER_*` variable.

Nothing else in ladder reads a `LADDER_*` variable: each is read through `environment_value`, when it is
used (not frozen at import), and docs/configuration.md has this table (a test keeps the two equal).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ladder.errors import LadderError


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str


CPU_DTYPE = "LADDER_CPU_DTYPE"
CPU_GEMM_TEMPLATES = "LADDER_CPU_GEMM_TEMPLATES"
DECODE_ATTENTION = "LADDER_DECODE_ATTENTION"
INDUCTOR_OPTIONS = "LADDER_INDUCTOR_OPTIONS"
DIST_TIMEOUT = "LADDER_DIST_TIMEOUT"
API_KEY = "LADDER_API_KEY"
CACHE_DIR = "LADDER_CACHE_DIR"
LAUNCHED_WORKER = "LADDER_LAUNCHED_WORKER"

VARIABLES = (
    Variable(CPU_DTYPE, "bfloat16 on a CPU with bf16 arithmetic (AVX-512 BF16, AMX), else float32",
             "The dtype on a CPU when `--dtype` is not given: float32, bfloat16 or float16."),
    Variable(CPU_GEMM_TEMPLATES, "1 for `ladder generate`, 0 for `ladder serve`",
             "1: a compiled CPU step takes the weights as constants of its graph, packed into inductor's C++ GEMM "
             "templates (2-3x faster decoding; a longer first compile; the cache entry holds the packed weights: "
             "136 MiB for SmolLM2 int8); 0: inductor's default GEMMs, "
             "weights as inputs. Either way a later start reads the whole compiled step from the cache."),
    Variable(DECODE_ATTENTION, "products for a compiled step on a CPU, matmul for an eager bf16 one with bf16 "
             "arithmetic, else sdpa",
             "A decode step's attention: sdpa (ATen), matmul (two batched products, for eager half-precision CPU "
             "steps), products (one loop nest, for compiled CPU steps) or flex (FlexAttention, compiled only)."),
    Variable(INDUCTOR_OPTIONS, "none",
             "A JSON object of inductor options that every compiled decode step adds to its own, e.g. "
             "'{\"coordinate_descent_tuning\": true}'."),
    Variable(DIST_TIMEOUT, "300",
             "Seconds a rank waits at the rendezvous or in a collective before every rank stops with an error."),
    Variable(API_KEY, "none", "`ladder serve`: the key clients must send (as `--api-key`)."),
    Variable(CACHE_DIR, "~/.cache/ladder",
             "What later starts read instead of doing it again: `gguf/`, each GGUF file converted once (float32 "
             "weights, 4 bytes a parameter); `inductor/`, torch.compile's own caches (compiled steps, kernels, "
             "autotuning; no weights: SmolLM2's, 1-16 MB a kind of step). off: neither (torch then keeps its kernels "
             "in its default folder)."),
    Variable(LAUNCHED_WORKER, "unset", "Set by ladder in the ranks it launches (`--nproc`); not for users."),
)
NAMES = frozenset(v.name for v in VARIABLES)
MEASURED = (CPU_DTYPE, CPU_GEMM_TEMPLATES, DECODE_ATTENTION, INDUCTOR_OPTIONS)
"""The variables that change what a step computes or how: a benchmark record keeps those that are set."""

DECODE_ATTENTION_KERNELS = ("sdpa", "matmul", "products", "flex")


def environment_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value (None when unset or empty); only the variables of the table."""
    if name not in NAMES:
        raise KeyError(f"{name} is not in ladder.options.VARIABLES")
    return (os.environ if environ is None else environ).get(name) or None


def cache_root() -> Path | None:
    """ladder's cache folder (`LADDER_CACHE_DIR`), None when the user turned it off."""
    value = environment_value(CACHE_DIR) or "~/.cache/ladder"
    return None if value == "off" else Path(value).expanduser()


def dist_timeout_s() -> float:
    text = environment_value(DIST_TIMEOUT) or "300"
    try:
        return float(text)
    except ValueError:
        raise LadderError(f"{DIST_TIMEOUT}={text!r} is not a number of seconds") from None


# How the engine runs a decode step. The options `--compile`, `--compile-layers` and `--cuda-graph` become a
# `DecodeStep` where a command parses them (`DecodeStep.from_flags`); everything after trusts it. Results
# files keep the three flags as booleans (their schema predates this value), and `of_record` reads them back.
class DecodeStep(Enum):
    """Values are the labels results tables show."""

    EAGER = "eager"
    COMPILED = "compiled"  # the whole step one torch.compile graph (CUDA graphs on CUDA: reduce-overhead)
    COMPILED_LAYERS = "compiled layers"  # each layer's branches compiled, one graph for all layers
    CUDA_GRAPH = "CUDA graph"  # the eager step captured as one CUDA graph
    COMPILED_LAYERS_CUDA_GRAPH = "compiled layers + CUDA graph"

    @classmethod
    def from_flags(cls, compile: bool = False, compile_layers: bool = False, cuda_graph: bool = False) -> DecodeStep:
        """The step the three command-line flags ask for; the combinations that make no sense are refused."""
        if compile and cuda_graph:
            raise LadderError("--cuda-graph and --compile both make the decode step a CUDA graph: give one")
        if compile and compile_layers:
            raise LadderError("--compile compiles the whole decode step and --compile-layers each layer: give one "
                              "(--compile-layers --cuda-graph: compiled layers in one CUDA graph)")
        if compile:
            return cls.COMPILED
        if compile_layers:
            return cls.COMPILED_LAYERS_CUDA_GRAPH if cuda_graph else cls.COMPILED_LAYERS
        return cls.CUDA_GRAPH if cuda_graph else cls.EAGER

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> DecodeStep:
        """The step a results record (or a bench point's description) ran."""
        return cls.from_flags(bool(record.get("compile")), bool(record.get("compile_layers")),
                              bool(record.get("cuda_graph")))

    @property
    def compiles_step(self) -> bool:
        return self is DecodeStep.COMPILED

    @property
    def compiles_layers(self) -> bool:
        return self in (DecodeStep.COMPILED_LAYERS, DecodeStep.COMPILED_LAYERS_CUDA_GRAPH)

    @property
    def captures_cuda_graph(self) -> bool:
        """Whether the step is replayed as one CUDA graph (`--compile` is too, on CUDA, by inductor)."""
        return self in (DecodeStep.CUDA_GRAPH, DecodeStep.COMPILED_LAYERS_CUDA_GRAPH)

    def flags(self) -> dict[str, bool]:
        """The three booleans results records keep."""
        return {"compile": self.compiles_step, "cuda_graph": self.captures_cuda_graph,
                "compile_layers": self.compiles_layers}


@dataclass(frozen=True)
class RuntimeOptions:
    """How an engine runs a model, chosen once when the engine is built (`ladder.runtime.engine.Engine`).

    `decode_attention` None is the step's default: "products" for a compiled step on a CPU (30 attentions of
    SmolLM2's shape in one graph: 1.9 ms against ATen's 5.7 at 256 positions; docs/compile.md), "matmul"
    for an eager one in half precision on a CPU with bf16 arithmetic but no AMX tiles (ATen's bf16 kernel is
    slow there for one query: `ladder.model.attention.matmul_decode_attention`), else "sdpa". The eager and compiled steps attend alike when it is given."""

    step: DecodeStep = DecodeStep.EAGER
    decode_attention: str | None = None
    cpu_gemm_templates: bool | None = None  # constant weights in inductor's C++ GEMM templates; None: per CPU kind
    inductor_options: Mapping[str, Any] = field(default_factory=dict)  # added to every compile of a step

    def __post_init__(self) -> None:
        kernel = self.decode_attention
        if kernel is not None and kernel not in DECODE_ATTENTION_KERNELS:
            raise LadderError(f"unknown decode attention {kernel!r}: pick one of {', '.join(DECODE_ATTENTION_KERNELS)}")

    @classmethod
    def from_environment(cls, step: DecodeStep = DecodeStep.EAGER,
                         environ: Mapping[str, str] | None = None) -> RuntimeOptions:
        """The options of `step` (from the command line's flags: `DecodeStep.from_flags`) and the
        environment's variables."""
        return cls(step=step, decode_attention=environment_value(DECODE_ATTENTION, environ),
                   cpu_gemm_templates=_flag(CPU_GEMM_TEMPLATES, environ),
                   inductor_options=parse_inductor_options(environment_value(INDUCTOR_OPTIONS, environ)))

    def decode_attention_on(self, device_type: str, slow_half_attention: bool = False) -> str:
        """The decode attention that runs on this kind of device (see the class's docstring);
        `slow_half_attention`: the step computes in half precision on a CPU where ATen's kernel is slow in it
        (bf16 arithmetic without AMX tiles)."""
        if self.decode_attention is not None:
            if self.decode_attention == "flex" and self.step.compiles_step and device_type == "cpu":
                raise LadderError(f"{DECODE_ATTENTION}=flex compiles on a CPU with --compile-layers, not --compile "
                                  "(inductor's CPU FlexAttention takes its mask only from the graph's inputs)")
            return self.decode_attention
        compiles = self.step.compiles_step or self.step.compiles_layers
        if device_type != "cpu":
            return "sdpa"
        return "products" if compiles else "matmul" if slow_half_attention else "sdpa"


def _flag(name: str, environ: Mapping[str, str] | None) -> bool | None:
    """A 0/1 variable: None when unset (its default depends on the machine)."""
    value = environment_value(name, environ)
    if value not in (None, "0", "1"):
        raise LadderError(f"{name}={value!r}: set 0 or 1")
    return None if value is None else value == "1"


def parse_inductor_options(text: str | None) -> dict[str, Any]:
    """The inductor options a JSON object names (none for None), each checked against inductor's config."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise LadderError(f"{INDUCTOR_OPTIONS} is not JSON ({e.msg}): {text}") from None
    if not isinstance(options, dict):
        raise LadderError(f"{INDUCTOR_OPTIONS} must be a JSON object of inductor options, got {text}")
    import torch._inductor.config as inductor_config

    unknown = sorted(set(options) - set(inductor_config.get_config_copy()))
    if unknown:
        raise LadderError(f"{INDUCTOR_OPTIONS}: inductor has no option {', '.join(map(repr, unknown))}")
    return options


def variables_table() -> str:
    """The table of every variable, as docs/configuration.md shows it (a test keeps the two equal)."""
    rows = ["| variable | default | what it sets |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)
