"""An eager server prefill of one prompt chunk, SmolLM2 in bf16 and fp32, and the bf16 one's top ops (torch
profiler): what a step that prefills beside running rows adds to their wait.

    PYTHONPATH=src .venv/bin/python experiments/investigations/prefill_chunk.py [--tokens 128]
"""

import argparse
import statistics
import time

import torch

from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.runtime.engine import Engine, PrefillChunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    chunk = [PrefillChunk(3, list(range(100, 100 + args.tokens)), 0)]
    with torch.inference_mode():
        for dtype in ("bfloat16", "float32"):
            model = ModelSpec(model="smollm2-135m-instruct", dtype=dtype, device="cpu").load(
                LocalCommunicator(), torch.device("cpu")).model
            engine = Engine(model)
            engine.reserve(8, 512)
            for _ in range(3):
                engine.prefill(chunk)
            times = []
            for _ in range(10):
                start = time.perf_counter()
                engine.prefill(chunk)
                times.append(time.perf_counter() - start)
            print(f"{dtype}: prefill of {args.tokens} tokens {statistics.median(times) * 1e3:.1f} ms", flush=True)
            if dtype == "bfloat16":
                with torch.profiler.profile() as profile:
                    for _ in range(3):
                        engine.prefill(chunk)
                print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
