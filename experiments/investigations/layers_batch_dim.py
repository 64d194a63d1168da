"""Compiled layers (`--compile-layers`, as `ladder serve` runs them) with the batch a constant of each graph
(the decode step names its rows as a slice: `decode_forward(rows_as_slice=True)`) against a symbolic batch
(rows None: dynamo makes the batch dynamic at the second batch size): the warm-up's graphs and seconds,
and the step's milliseconds at batch 1, 4 and 8 (SmolLM2 int8, cache of 1024, position 500). Run it twice
for each: the first run of each fills torch's compile cache.

    PYTHONPATH=src .venv/bin/python experiments/investigations/layers_batch_dim.py slice|none
"""

import functools
import sys
import time

import torch
from torch._dynamo.utils import counters

from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.runtime import engine as engine_module


def main() -> None:
    rows = sys.argv[1] if len(sys.argv) > 1 else "slice"
    loaded = ModelSpec(model="smollm2-135m-instruct", quantize="int8").load(LocalCommunicator(), torch.device("cpu"))
    engine = engine_module.Engine(loaded.model, DecodeStep.COMPILED_LAYERS)
    engine._forward = functools.partial(engine_module.decode_forward, engine._step_model,
                                        rows_as_slice=rows == "slice")
    engine.reserve(8, 1024, padded=True)
    start = time.perf_counter()
    engine.warm_up()
    print(f"rows {rows}: warm-up {time.perf_counter() - start:.1f} s, {counters['stats']['unique_graphs']} graphs")
    with torch.inference_mode():
        for batch in (1, 4, 8):
            tokens, positions = torch.zeros(batch, dtype=torch.long), [500] * batch
            for _ in range(3):
                engine.decode(tokens, positions)
            start = time.perf_counter()
            for _ in range(20):
                engine.decode(tokens, positions)
            print(f"  batch {batch}: {(time.perf_counter() - start) / 20 * 1e3:.1f} ms a step")


if __name__ == "__main__":
    main()
