"""Whether each shape of a compiled step with inductor's GEMM templates holds its own packed copy of the
weights (why `ladder serve` leaves the templates off unless asked: `ladder.serve.worker.serving_options`):
SmolLM2 int8 in bf16, the step at batch 1 and caches of 64 and 128 positions, the process's resident
memory after the load and after each shape is made. From torch's compile cache where it holds them.

    LADDER_CPU_GEMM_TEMPLATES=1 PYTHONPATH=src .venv/bin/python experiments/investigations/templated_shapes_memory.py
"""

import os

import torch

from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    spec = ModelSpec(model="smollm2-135m-instruct", dtype="bfloat16", quantize="int8")
    loaded = spec.load(LocalCommunicator(), torch.device("cpu"))
    print(f"loaded: {resident_mib():.0f} MiB", flush=True)
    engine = Engine(loaded.model, DecodeStep.COMPILED)
    engine.reserve(1, 128, padded=True)
    print(f"shapes {engine.shapes}: {resident_mib():.0f} MiB", flush=True)
    engine.warm_up(lambda done, of: print(f"{done} of {of} made: {resident_mib():.0f} MiB", flush=True))


if __name__ == "__main__":
    main()
