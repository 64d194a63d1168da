"""`--comm-share`: an emulated link dilated so that its all-reduces take a given share of standard's
decode step on this machine (CPU), calibrated before the sweep by timing that step."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ladder.bench.records import settings
from ladder.bench.spec import BenchPoint
from ladder.bench.worker import build_models
from ladder.comm.distributed import pick_device
from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.launch import launch, under_torchrun
from ladder.errors import LadderError
from ladder.runtime.engine import Engine

_NO_DURATION = 1e-9  # a link scale whose waits are nothing, and whose modelled time / it is the undilated time


def calibrate_link_scale(point: BenchPoint, share: float, steps: int = 16) -> tuple[float, float, float]:
    """`--comm-share`: the link scale at which the emulated all-reduces take `share` of standard's decode
    step on this machine, and the two times it comes from (compute and undilated link, s a step).

    A fixed `--link-scale` keeps the link, so the compute : communication ratio moves with this machine's
    speed on the day (a shared VM's speed varies from day to day); this keeps the ratio where
    the modelled GPUs have it. Rank 0's standard shard is timed over a link of no duration, in a worker
    like the measured ones (same threads)."""
    compute_s, link_s = launch(_standard_step_times, 1, point, steps, isolate=True, device=point.device)[0]
    if link_s <= 0:
        raise LadderError(f"--comm-share: {point.preset} at tp={point.tp} sends nothing to dilate")
    return share / (1 - share) * compute_s / link_s, compute_s, link_s


def dilate_to_share(points: Sequence[BenchPoint], share: float, done: dict[str, dict[str, Any]],
                    report: Callable[[str], None]) -> list[BenchPoint]:
    """The emulated points with the link scale that gives `share` (`calibrate_link_scale`), one
    calibration per configuration; with `--resume`, the scale a configuration was measured at before."""
    check_comm_share(points, share)
    earlier = {_without_scale(r): r["link_scale"] for r in done.values() if r.get("comm_share") == share}
    scales: dict[str, float] = {}
    out = []
    for point in points:
        if not point.emulated:
            out.append(point)
            continue
        key = _without_scale(point.with_dtype_resolved().describe())
        if key not in scales:
            where = f"  --comm-share {share:g}: {point.interconnect} tp={point.tp} bs={point.batch_size}"
            if key in earlier:
                scales[key] = earlier[key]
                report(f"{where}: x{scales[key]:.3g}, as measured before (--resume)")
            else:
                scales[key], compute_s, link_s = calibrate_link_scale(point, share)
                report(f"{where}: x{scales[key]:.3g} (standard's step here: {compute_s * 1e3:.2f} ms of compute, "
                       f"{link_s * 1e3:.3f} ms on the undilated link)")
        out.append(dataclasses.replace(point, link_scale=scales[key], comm_share=share))
    return out


def check_comm_share(points: Sequence[BenchPoint], share: float) -> None:
    """Refuse a `--comm-share` that cannot be calibrated, before anything runs."""
    if not 0 < share < 1:
        raise LadderError(f"--comm-share is a share of the step, between 0 and 1, not {share:g}")
    if any(p.link_scale != 1 for p in points):
        raise LadderError("--comm-share and --link-scale both set how far the link is dilated: give one")
    if not any(p.emulated for p in points):
        raise LadderError("--comm-share dilates an emulated link, and --interconnect real has none: "
                          "name one, e.g. --interconnect pcie-no-p2p")
    if under_torchrun():
        raise LadderError("--comm-share calibrates on one process: under torchrun give every rank the same "
                          "--link-scale")
    if any(pick_device(p.device).type != "cpu" for p in points if p.emulated):
        raise LadderError("--comm-share calibrates CPU steps; on a GPU use the link's own times "
                          "(--link-scale 1) or a --link-scale of your choice")


def _without_scale(description: dict[str, Any]) -> str:
    """A point's settings but its layout and link scale: what one calibration serves."""
    return json.dumps(settings(description, frozenset({"layout", "ladder_layers", "link_scale", "comm_share"})),
                      sort_keys=True)


def _standard_step_times(point: BenchPoint, steps: int) -> tuple[float, float]:
    """Median compute time of standard's decode step (eager or compiled, as the point will run it), and
    its all-reduces' undilated link time."""
    device = pick_device(point.device)
    comm = EmulatedCommunicator(point.link, point.tp, device, _NO_DURATION)
    point = dataclasses.replace(point, layout="standard", ladder_layers=None)
    engine = Engine(build_models([point], [comm], device)[0], point.decode_step)
    engine.reserve(point.batch_size, point.prompt_len + point.gen_len)
    token = torch.zeros(point.batch_size, dtype=torch.long, device=device)
    times = []
    with torch.inference_mode():
        for i in range(steps + 3):  # 3 warm-up steps (compiling, if the point compiles)
            if i == 3:
                comm.reset_counters()
            start = time.perf_counter()
            engine.decode(token, [point.prompt_len + i % point.gen_len] * point.batch_size)
            times.append(time.perf_counter() - start)
    return statistics.median(times[3:]), comm.modelled_s / _NO_DURATION / steps
