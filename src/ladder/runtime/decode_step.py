"""How the engine runs a decode step: eager, compiled, compiled layers, CUDA graph (one value, checked once).

The options `--compile`, `--compile-layers` and `--cuda-graph` become a `DecodeStep` where a command
parses them (`DecodeStep.from_flags`); everything after trusts it. Results files keep the three flags
as booleans (their schema predates this value), and `DecodeStep.of_record` reads them back.
"""

from __future__ import annotations

import json
import os
from enum import Enum
from typing import Any

from ladder.errors import LadderError

DECODE_ATTENTION_VARIABLE = "LADDER_DECODE_ATTENTION"
"""sdpa, products or flex: how a compiled decode step attends (`ladder.model.transformer.decode_attention_kernel`), to
measure them against each other on a GPU (scripts/gpu_checks.sh, step `variants`); unset: the device's
default."""
INDUCTOR_OPTIONS_VARIABLE = "LADDER_INDUCTOR_OPTIONS"
"""A JSON object of inductor options that every compile of a decode step (`--compile`, `--compile-layers`)
adds to its own, to measure them on a GPU (scripts/gpu_checks.sh, step `variants`), e.g.
'{"coordinate_descent_tuning": true}' (gpt-fast's setting: each Triton kernel's block sizes tuned)."""


def inductor_options() -> dict[str, Any]:
    """The options LADDER_INDUCTOR_OPTIONS gives (none when it is unset)."""
    text = os.environ.get(INDUCTOR_OPTIONS_VARIABLE)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise LadderError(f"{INDUCTOR_OPTIONS_VARIABLE} is not JSON ({e.msg}): {text}") from None
    if not isinstance(options, dict):
        raise LadderError(f"{INDUCTOR_OPTIONS_VARIABLE} must be a JSON object of inductor options, got {text}")
    import torch._inductor.config as inductor_config

    unknown = sorted(set(options) - set(inductor_config.get_config_copy()))
    if unknown:
        raise LadderError(f"{INDUCTOR_OPTIONS_VARIABLE}: inductor has no option {', '.join(map(repr, unknown))}")
    return options


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
