"""Where a decode step's time goes on an emulated link: compute, exposed transfer, and the rest.

Rank 0's TP-4 shard of the llama-160m shape, one process, one thread; standard, ladder and upper bound
share one set of weights and take turns step by step (random order), so the machine's drift hits them
alike. Every all-reduce is a transfer on the pcie-no-p2p link dilated as `scripts/run.sh` dilates it at
batch 1 (x10). Upper bound's step is the compute; a layout's step should be that plus its exposed
transfer (the part of the modelled transfers still running when compute asked for the result). What is
left over is a cost of waiting on this machine that the link model does not hold, and the whole-run
hidden fraction, (t_standard - t_ladder) / (t_standard - t_upper-bound), counts it. Last, it times one
of the shard's matrix products right after a wait of one modelled transfer and right after another
product: the first runs slower here, which is most of standard's rest (24 waits a step).

    .venv/bin/python experiments/investigations/step_accounting.py [--steps 150] [--scale 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode_in_turns import decode_in_turns  # scripts/, on sys.path when a script runs
from ladder.comm.emulated import wait_until

LAYOUTS = ("standard", "ladder", "upper-bound")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="decode steps per layout")
    parser.add_argument("--scale", type=float, default=10.0, help="link dilation (--link-scale)")
    args = parser.parse_args()

    comms, models, step_s = decode_in_turns(LAYOUTS, "pcie-no-p2p", args.scale, args.steps)
    compute_ms = statistics.median(step_s[LAYOUTS.index("upper-bound")]) * 1e3
    print(f"llama-160m TP-4 shard, pcie-no-p2p x{args.scale:g}, {args.steps} decode steps per layout "
          f"(medians, ms per step)")
    print(f"{'layout':<12}{'step':>8}{'compute':>9}{'modelled':>10}{'exposed':>9}{'rest':>7}")
    for layout, comm, times in zip(LAYOUTS, comms, step_s):
        step_ms = statistics.median(times) * 1e3
        modelled_ms = comm.modelled_s / args.steps * 1e3
        exposed_ms = comm.exposed_s / args.steps * 1e3
        print(f"{layout:<12}{step_ms:>8.2f}{compute_ms:>9.2f}{modelled_ms:>10.2f}{exposed_ms:>9.2f}"
              f"{step_ms - compute_ms - exposed_ms:>7.2f}")
    t = {layout: statistics.median(times) for layout, times in zip(LAYOUTS, step_s)}
    hidden = (t["standard"] - t["ladder"]) / (t["standard"] - t["upper-bound"])
    ladder = comms[LAYOUTS.index("ladder")]
    print(f"hidden, from these step times: {hidden:.2f}; inside the run: {1 - ladder.exposed_s / ladder.modelled_s:.2f}")
    transfer_s = ladder.modelled_s / ladder.count
    after_wait, after_product = product_times_us(models[0].layers[0].feed_forward.w13.weight, transfer_s)
    print(f"one matrix product (w13 of a layer, batch 1): {after_wait:.0f} us right after a {transfer_s * 1e6:.0f} us "
          f"wait, {after_product:.0f} us right after another product (medians of 1000)")


def product_times_us(weight: torch.Tensor, wait_s: float, repeats: int = 1000) -> tuple[float, float]:
    x = torch.randn(1, weight.shape[1])
    after_wait, after_product = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            wait_until(time.perf_counter() + wait_s)
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            after_wait.append(time.perf_counter() - start)
            torch.nn.functional.linear(x, weight)
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            after_product.append(time.perf_counter() - start)
    return statistics.median(after_wait) * 1e6, statistics.median(after_product) * 1e6


if __name__ == "__main__":
    main()
