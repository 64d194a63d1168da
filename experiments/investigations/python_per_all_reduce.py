"""The Python a layout's all-reduces cost over upper bound, on an emulated link of no duration.

Rank 0's TP-4 shard of the llama-160m shape, one process, one thread; ladder, upper bound and standard
share one set of weights and take turns step by step (a drawn order each turn). The link is dilated to
nothing (x1e-9), so what ladder and standard take beyond upper bound is the Python of their residual
bookkeeping and of the emulated launches and waits, which the CPU benchmark charges to them. Printed per
all-reduce: the median over steps of (layout's step - upper bound's step in the same turn) / all-reduces
a step.

    .venv/bin/python experiments/investigations/python_per_all_reduce.py [--steps 600]
"""

from __future__ import annotations

import argparse
import statistics

from decode_in_turns import decode_in_turns  # scripts/, on sys.path when a script runs

LAYOUTS = ("ladder", "upper-bound", "standard")
_NO_DURATION = 1e-9  # the link's dilation: every wait is nothing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="decode steps per layout")
    args = parser.parse_args()

    _, models, step_s = decode_in_turns(LAYOUTS, "pcie-no-p2p", _NO_DURATION, args.steps)
    all_reduces = 2 * models[0].config.n_layers
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
