"""A server step that carries a prompt chunk beside running rows: one forward (`Engine.decode_and_prefill`)
against a decode forward then a prefill forward (the step before it), on SmolLM2-135M-Instruct, eager, as
`ladder serve` runs it. D running rows at cache position 200, one chunk of T prompt tokens; median of
`--rounds` steps of each, in turns, milliseconds. The decode forward alone and the prefill alone are
timed too: what a running row waits for is the step. `--step compile` or `compile-layers`: the decode
forward is the server's compiled step (by handle, `ladder.serve.worker.serving_options`), and the one
forward the eager view's.

    .venv/bin/python experiments/investigations/mixed_step.py [--dtype float32] [--rows 7] [--chunks 32,128,256]
        [--step eager|compile|compile-layers]
"""

import argparse
import statistics
import time

import torch

from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine, PrefillChunk
from ladder.serve.worker import serving_options

STEPS = {"eager": DecodeStep.EAGER, "compile": DecodeStep.COMPILED, "compile-layers": DecodeStep.COMPILED_LAYERS}


def timed_ms(step) -> float:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=7)
    parser.add_argument("--chunks", default="32,128,256")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--step", choices=STEPS, default="eager")
    args = parser.parse_args()
    model = ModelSpec(model=args.model, dtype=args.dtype).load(LocalCommunicator(), torch.device("cpu")).model
    engine = Engine(model, serving_options(STEPS[args.step]))
    engine.reserve(args.rows + 1, 1024, padded=True)
    D = args.rows
    tokens, positions = list(range(100, 100 + D)), [200] * D
    print(f"{args.model} {args.dtype}, {args.step} decode step, {D} running rows at position 200, "
          f"{torch.get_num_threads()} threads")
    print("| prompt chunk | decode alone | prefill alone | decode, then prefill | one forward | saved |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for T in [int(x) for x in args.chunks.split(",")]:
            chunk = [PrefillChunk(D, list(range(1000, 1000 + T)), 0)]
            steps = {"decode": lambda: engine.decode(tokens, positions),
                     "prefill": lambda: engine.prefill(chunk),
                     "two": lambda: (engine.decode(tokens, positions), engine.prefill(chunk)),
                     "one": lambda: engine.decode_and_prefill(tokens, positions, chunk)}
            times: dict[str, list[float]] = {name: [] for name in steps}
            for _ in range(2):  # warm-up
                for step in steps.values():
                    step()
            for _ in range(args.rounds):
                for name, step in steps.items():
                    times[name].append(timed_ms(step))
            ms = {name: statistics.median(t) for name, t in times.items()}
            print(f"| {T} | {ms['decode']:.1f} | {ms['prefill']:.1f} | {ms['two']:.1f} | {ms['one']:.1f} | "
                  f"{1 - ms['one'] / ms['two']:.0%} |")


if __name__ == "__main__":
    main()
