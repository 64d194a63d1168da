"""`ladder bench link`: time this machine's real all-reduce across message sizes, as nccl-tests'
all_reduce_perf does, and fit the link model that `--interconnect custom` takes.

With it a sweep can emulate the link a user actually has (`ladder bench --interconnect custom ...`:
the same link, its waits occupying no compute, which sets apart what the schedule hides from what
the real collective costs the compute it overlaps), and `ladder predict` can price it. Each size is
timed through the communicator the model itself uses, one all-reduce at a time between barriers,
and reported as the slowest rank's median: a collective is done when every rank is.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, replace
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from ladder.comm.distributed import from_every_rank, init_distributed, shutdown_distributed
from ladder.comm.launch import launch
from ladder.comm.links import LinkModel, fit_link
from ladder.errors import LadderError
from ladder.runtime.step_clock import synchronize

# Ladder's own messages span these: a decode step's all-reduce of a 70B model is batch x 16 KiB, a
# 1024-token prefill's 16 MiB a sequence.
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """`4096`, `4K`, `16M` or `1G` (binary units, as nccl-tests takes them) in bytes."""
    match = re.fullmatch(r"(\d+)([KMG]?)(?:i?B)?", text.strip(), flags=re.IGNORECASE)
    if match is None or int(match.group(1)) == 0:
        raise LadderError(f"--sizes takes sizes such as 4096, 64K or 16M, got {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(n_bytes: int) -> str:
    for unit in ("G", "M", "K"):
        if n_bytes >= _UNITS[unit] and n_bytes % _UNITS[unit] == 0:
            return f"{n_bytes // _UNITS[unit]} {unit}iB"
    return f"{n_bytes} B"


@dataclass(frozen=True)
class AllReduceTiming:
    tp: int
    n_bytes: int
    seconds: float  # the slowest rank's median over the timed all-reduces

    @property
    def algbw_gbps(self) -> float:
        """nccl-tests' algorithm bandwidth: the message over the time."""
        return self.n_bytes / self.seconds / 1e9

    @property
    def busbw_gbps(self) -> float:
        """nccl-tests' bus bandwidth: what each rank's link carries in a ring all-reduce, 2 (n-1)/n of
        the message; the figure a link model's bandwidth is (`LinkModel.all_reduce_s`)."""
        return self.algbw_gbps * 2 * (self.tp - 1) / self.tp


def time_all_reduces(sizes: list[int], dtype_name: str, device: str, warmup: int, iters: int) -> list[float]:
    """On every rank of a launched group: the slowest rank's median seconds of one all-reduce of each size."""
    ctx = init_distributed(device)
    try:
        comm, dtype = ctx.communicator(), getattr(torch, dtype_name)
        messages = [torch.ones(n_bytes // dtype.itemsize, dtype=dtype, device=ctx.device) for n_bytes in sizes]
        for x in messages:  # every size first: the group's first collectives also set up its connections
            for _ in range(warmup):
                comm.all_reduce(x)
        medians = []
        for x in messages:
            seconds = []
            for _ in range(iters):
                dist.barrier()  # every rank starts together: the time is the collective's, not a late peer's
                synchronize(ctx.device)
                start = perf_counter()
                comm.all_reduce(x)
                synchronize(ctx.device)
                seconds.append(perf_counter() - start)
            medians.append(statistics.median(seconds))
        return [max(per_rank) for per_rank in zip(*from_every_rank(medians))]
    finally:
        shutdown_distributed()


def check_sizes(sizes: list[int], dtype_name: str) -> None:
    itemsize = getattr(torch, dtype_name).itemsize
    uneven = [s for s in sizes if s % itemsize]
    if uneven:
        raise LadderError(f"--sizes: {uneven[0]} bytes is not a whole number of {dtype_name} elements ({itemsize} bytes)")


def measure_link(tps: list[int], sizes: list[int], dtype_name: str = "float32", device: str = "auto",
                 warmup: int = 5, iters: int = 20) -> list[AllReduceTiming]:
    """Launch each TP degree's ranks (or, under torchrun, be one of them) and time every size."""
    if min(tps) < 2:
        raise LadderError(f"--tp must be at least 2 to have an all-reduce to time, got {min(tps)}")
    if warmup < 0 or iters < 1:
        raise LadderError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")
    check_sizes(sizes, dtype_name)
    timings = []
    for tp in tps:
        seconds = launch(time_all_reduces, tp, sizes, dtype_name, device, warmup, iters, device=device)
        timings += [AllReduceTiming(tp, n, s) for n, s in zip(sizes, next(iter(seconds.values())))]
    return timings


def fit_measured_link(timings: list[AllReduceTiming], where: str) -> LinkModel:
    """The latency + bandwidth link through the timings (relative least squares, as the presets)."""
    measurements = [(t.tp, [(1, t.n_bytes)], t.seconds * 1e6) for t in timings]
    link = fit_link("measured", measurements, f"ladder bench link on {where}")
    if link.latency_us < 0 or link.latency_per_rank_us < 0:  # sizes all so large that latency drowns in noise
        link = _bandwidth_only(timings, link)
    if link.bandwidth_gbps <= 0:  # (1 / bandwidth is the slope: time did not grow with the size)
        raise LadderError("the all-reduce took no longer for larger messages than for smaller ones, so no bandwidth "
                          "can be fitted: time a wider range, e.g. --sizes 4K,64K,1M,16M (or more --iters)")
    return link


def _bandwidth_only(timings: list[AllReduceTiming], link: LinkModel) -> LinkModel:
    """The link of no latency closest to the timings, in relative error: with r = ring bytes / time,
    minimising sum (s r - 1)^2 over the seconds per byte s gives s = sum r / sum r^2."""
    rates = [2 * (t.tp - 1) / t.tp * t.n_bytes / t.seconds for t in timings]  # bytes per second
    seconds_per_byte = sum(rates) / sum(r * r for r in rates)
    return replace(link, latency_us=0.0, latency_per_rank_us=0.0, bandwidth_gbps=1 / seconds_per_byte / 1e9)


def format_bandwidth(gbps: float) -> str:
    return f"{gbps:.1f}" if gbps >= 10 else f"{gbps:.3f}"


def describe_fit(link: LinkModel, timings: list[AllReduceTiming]) -> list[str]:
    """How well the fitted link reproduces the timings, and the options that give it to bench and predict."""
    worst = max(abs(link.all_reduce_s(t.n_bytes, t.tp) / t.seconds - 1) for t in timings)
    tps = sorted({t.tp for t in timings})
    at = (f"the latency at tp {tps[0]}, assumed at every tp" if len(tps) == 1
          else f"{link.latency_us:.1f} us at tp 2, +{link.latency_per_rank_us:.1f} us per rank beyond")
    bandwidth = format_bandwidth(link.bandwidth_gbps)
    options = f"--interconnect custom --link-latency-us {link.latency_us:.1f} --link-bandwidth-gbps {bandwidth}"
    return [f"fitted link: {link.latency_us:.1f} us + ring bytes / {bandwidth} GB/s ({at}); "
            f"within {worst:.0%} of every size",
            f"  as options of ladder bench and ladder predict: {options}"]


def format_timings(timings: list[AllReduceTiming], link: LinkModel) -> str:
    lines = [f"{'tp':>3} {'size':>9} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11} {'fit (us)':>9}"]
    for t in timings:
        lines.append(f"{t.tp:>3} {format_size(t.n_bytes):>9} {t.seconds * 1e6:>11.1f} {t.algbw_gbps:>11.3f} "
                     f"{t.busbw_gbps:>11.3f} {link.all_reduce_s(t.n_bytes, t.tp) * 1e6:>9.1f}")
    return "\n".join(lines)


def report(timings: list[AllReduceTiming], link: LinkModel) -> dict[str, Any]:
    """What `--json` prints: every timing with its bandwidths, and the fitted link."""
    rows = [{**asdict(t), "algbw_gbps": t.algbw_gbps, "busbw_gbps": t.busbw_gbps} for t in timings]
    return {"timings": rows, "link": link.to_dict()}
