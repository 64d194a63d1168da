"""The Python a layout's all-reduces cost over upper bound, on an emulated link of no duration.

Rank 0's TP-4 shard of the llama-160m shape, one process, one thread; ladder, upper bound and standard
share one set of weights and take turns step by step (a drawn order each turn). The link is dilated to
nothing (x1e-9), so what ladder and standard take beyond upper bound is the Python of their residual
bookkeeping and of the emulated launches and waits, which the CPU benchmark charges to them. Printed per
all-reduce: the median over steps of (layout's step - upper bound's step in the same turn) / all-reduces
a step.

    .venv/bin/python scripts/python_per_all_reduce.py [--steps 600]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ladder.config import get_preset
from ladder.interconnect import EmulatedCommunicator, get_link
from ladder.weights import build_model, init_local_shard, share_weights

LAYOUTS = ("ladder", "upper-bound", "standard")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="decode steps per layout")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    comms = [EmulatedCommunicator(get_link("pcie-no-p2p"), 4, cpu, scale=1e-9) for _ in LAYOUTS]
    configs = [get_preset("llama-160m").replace(layout=layout) for layout in LAYOUTS]
    owner = build_model(configs[0], comms[0], cpu)
    init_local_shard(owner, seed=0)
    models = [owner] + [share_weights(c, comm, owner) for c, comm in zip(configs[1:], comms[1:])]
    token = torch.zeros(1, 1, dtype=torch.long)
    step_s: list[list[float]] = [[] for _ in LAYOUTS]
    order = random.Random(0)
    with torch.inference_mode():
        for model in models:
            model.eval().setup_caches(1, 128)
            for pos in range(5):  # warm-up
                model(token, torch.tensor([pos]))
        for step in range(args.steps):
            turns = list(range(len(LAYOUTS)))
            order.shuffle(turns)
            for j in turns:
                position = torch.tensor([5 + step % 100])
                start = time.perf_counter()
                models[j](token, position)
                step_s[j].append(time.perf_counter() - start)

    all_reduces = 2 * configs[0].n_layers
    upper = step_s[LAYOUTS.index("upper-bound")]
    print(f"llama-160m TP-4 shard, emulated link of no duration, {args.steps} decode steps per layout")
    for layout, times in zip(LAYOUTS, step_s):
        if layout == "upper-bound":
            continue
        over_us = statistics.median(t - u for t, u in zip(times, upper)) / all_reduces * 1e6
        print(f"{layout:<10} step {statistics.median(times) * 1e3:6.2f} ms, over upper bound "
              f"{over_us:4.1f} us an all-reduce")
    print(f"upper bound step {statistics.median(upper) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
