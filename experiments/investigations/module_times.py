"""One layer's attention and MLP modules of rank 0's TP-4 llama-160m shard, timed alone, against the
duration of one emulated all-reduce of their output: whether a transfer outlasts the module it overlaps.

    .venv/bin/python experiments/investigations/module_times.py [--batch 4] [--scale 25] [--link pcie-no-p2p]"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.links import get_link
from ladder.model.config import get_preset
from ladder.model.weights import build_model, init_local_shard


def median_ms(run: Callable[[], object], repeats: int = 300) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--scale", type=float, default=25.0, help="link dilation (--link-scale)")
    parser.add_argument("--link", default="pcie-no-p2p")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    comm = EmulatedCommunicator(get_link(args.link), 4, cpu, args.scale)
    model = build_model(get_preset("llama-160m").replace(layout="upper-bound"), comm, cpu)
    init_local_shard(model, seed=0)
    model.eval().setup_caches(args.batch, 128)
    layer = model.layers[3]
    x = torch.randn(args.batch, 1, model.config.dim)
    position = torch.tensor([70])
    rope = model.rope(position, x.dtype)
    mask = torch.arange(model.max_seq)[None, :] <= position[:, None]
    with torch.inference_mode():
        attention = median_ms(lambda: layer.attention_branch(x, rope, position, mask))
        mlp = median_ms(lambda: layer.mlp_branch(x))
    print(f"batch {args.batch}: attention {attention:.2f} ms, MLP {mlp:.2f} ms; one all-reduce on "
          f"{args.link} x{args.scale:g}: {comm.duration_s(x) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
