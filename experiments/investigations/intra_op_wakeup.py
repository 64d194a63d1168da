"""Why compute right after a long wait can run slow on a loaded CPU: torch's intra-op worker threads sleep
during the wait, and waking them takes a scheduler slice when other work holds the cores.

Three tiny-model layouts take turns step by step (`ladder.bench.generate_in_turns`); standard and ladder
wait on an emulated link of LATENCY ms an all-reduce, upper bound does not communicate. Beside two busy
loops (started here, ended at exit), it prints upper bound's decode time over its 3 steps, which counts
its own steps only, for 1 and 2 intra-op threads. About 30 s on 2 cores.

    .venv/bin/python experiments/investigations/intra_op_wakeup.py [--latency-ms 25] [--repeats 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics

import torch

from ladder.bench.worker import generate_in_turns
from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.links import LinkModel
from ladder.model.config import get_preset
from ladder.model.weights import random_model, share_weights
from ladder.runtime.engine import Engine
from ladder.runtime.sampling import SamplingParams


def busy_loop() -> None:
    while True:
        pass


def upper_bound_decode_ms(latency_ms: float) -> float:
    cpu = torch.device("cpu")
    link = LinkModel("slow", latency_us=latency_ms * 1e3, bandwidth_gbps=1.0)
    comms = [EmulatedCommunicator(link, 2, cpu) for _ in range(3)]
    standard = random_model(get_preset("tiny", layout="standard"), comms[0], cpu, seed=3)
    others = [share_weights(get_preset("tiny", layout=layout), comm, standard)
              for layout, comm in zip(["ladder", "upper-bound"], comms[1:])]
    engines = [Engine(model) for model in [standard, *others]]
    prompt, sampling = torch.tensor([[5, 17, 42, 7], [9, 3, 200, 1]]), SamplingParams(temperature=0.8, seed=4)
    return generate_in_turns(engines, prompt, 4, sampling, shift=1)[2].decode_s * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    loops = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(2)]
    for p in loops:
        p.start()
    try:
        print(f"upper bound's 3 decode steps (ms) beside 2 busy loops, links of {args.latency_ms:g} ms")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = [upper_bound_decode_ms(args.latency_ms) for _ in range(args.repeats)]
            print(f"{threads} intra-op thread(s): median {statistics.median(times):6.1f}  max {max(times):6.1f}")
    finally:
        for p in loops:
            p.terminate()


if __name__ == "__main__":
    main()
