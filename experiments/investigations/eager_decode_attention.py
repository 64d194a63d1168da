"""An eager bf16 decode step's attention on a CPU with bf16 arithmetic: ATen's flash kernel in bf16 ("sdpa"),
the same upcast to float32 ("upcast": the cache copied to float32 each call), and two batched products
(`ladder.model.attention.matmul_decode_attention`, "matmul"), in SmolLM2's whole eager decode step (random
weights, packed linears) at B rows whose sequences are S positions long. Medians of 15 steps.

    PYTHONPATH=src .venv/bin/python experiments/investigations/eager_decode_attention.py [--batches 1,8]
        [--positions 64,256,1024]
"""

import argparse

import torch

from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.runtime.engine import Engine
from timing import median_ms  # (this folder: first on sys.path when a script runs)

KERNELS = {"sdpa": ("sdpa", None), "upcast": ("sdpa", torch.float32), "matmul": ("matmul", None)}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--positions", default="64,256,1024")
    args = parser.parse_args()
    model = ModelSpec(preset="smollm2-135m", device="cpu", dtype="bfloat16").load(
        LocalCommunicator(), torch.device("cpu"), exact=False).model
    engine = Engine(model)
    lengths = [int(p) for p in args.positions.split(",")]
    engine.reserve(max(map(int, args.batches.split(","))), max(lengths) + 2)
    print("| rows | positions | " + " | ".join(f"{name} (ms)" for name in KERNELS) + " |\n|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        for length in lengths:
            times = []
            for kernel, compute_dtype in KERNELS.values():
                engine.model.attend_with(kernel, compute_dtype)
                times.append(median_ms(lambda: engine.decode([1] * batch, [length - 1] * batch), 15))
            print(f"| {batch} | {length} | " + " | ".join(f"{ms:.1f}" for ms in times) + " |", flush=True)


if __name__ == "__main__":
    main()
