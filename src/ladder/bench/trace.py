"""Profiler traces of a generation, and what they show: how much of the communication ran while
compute did.

`profile_generation` runs one short generation under torch.profiler and writes a Chrome trace (open
it in https://ui.perfetto.dev or chrome://tracing). Communication appears as intervals of its own:
  * emulated links on CUDA: the sleep kernels on the side stream (`spin_kernel`), seen by the profiler;
  * emulated links on CPU: the communicator logs each modelled transfer's (start, end) on the host
    clock; they are added to the trace as a "link" track, aligned through a marker whose host time
    is known;
  * real NCCL: its kernels (`nccl...`); real gloo: the `gloo:all_reduce` ranges of its worker threads.
`link_overlap` reads a trace back: the share of communication time during which compute ran.
For ladder it is high, for standard near zero: the proof that the schedule overlaps.
"""

from __future__ import annotations

import bisect
import gzip
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ladder.comm.emulated import EmulatedCommunicator
from ladder.files import atomic_write

SYNC_MARKER = "ladder.clock_sync"
SYNC_MARKERS = 16
LINK_EVENT = "emulated all-reduce"
_CUDA_LINK_KERNELS = ("spin_kernel", "nccl")
_GLOO_WORK = "gloo:"  # gloo annotates each collective on its worker thread, e.g. "gloo:all_reduce"


def profile_generation(engine: Any, prompt: torch.Tensor, new_tokens: int, sampling: Any, comm: Any,
                       path: Path, max_seq: int | None = None) -> list[dict[str, Any]]:
    """Generate `new_tokens` under the profiler, write the Chrome trace to `path`, return its events.
    `max_seq`: the KV cache length; the measured runs' keeps a compiled step from being recompiled
    (and the compiler's own work from filling the trace)."""
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    log_transfers = isinstance(comm, EmulatedCommunicator) and engine.device.type == "cpu"
    if log_transfers:
        comm.transfers = []
    try:
        with profile(activities=activities) as prof:
            sync_host_s = []
            for _ in range(SYNC_MARKERS):
                sync_host_s.append(time.perf_counter())
                with record_function(SYNC_MARKER):
                    pass
            engine.generate(prompt, new_tokens, sampling, max_seq=max_seq)
        transfers = list(comm.transfers) if log_transfers else []
    finally:
        if log_transfers:
            comm.transfers = None
    path.parent.mkdir(parents=True, exist_ok=True)
    events: list[dict[str, Any]] = []

    def export(tmp: Path) -> None:
        prof.export_chrome_trace(str(tmp))
        trace = json.loads(tmp.read_text())
        if transfers:
            trace["traceEvents"].extend(_link_events(trace["traceEvents"], sync_host_s, transfers))
            tmp.write_text(json.dumps(trace))
        events.extend(trace["traceEvents"])
    atomic_write(path, export)
    return events


def _link_events(events: list[dict[str, Any]], sync_host_s: list[float],
                 transfers: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """The logged transfers as trace events on the trace's clock, on a track of their own.

    Each marker starts a little after its host time was read (the first one ~0.2 ms late, while the
    profiler warms up), so the smallest trace-minus-host difference is the clock offset. It is good
    to a microsecond or two: shares read from transfers of a few microseconds are noise."""
    markers = sorted((e for e in events if e.get("name") == SYNC_MARKER), key=lambda e: float(e["ts"]))
    offset_us = min(float(m["ts"]) - host * 1e6 for m, host in zip(markers, sync_host_s))
    pid = markers[0].get("pid", 0)
    return [{"ph": "X", "cat": "link", "name": LINK_EVENT, "pid": pid, "tid": "link",
             "ts": start * 1e6 + offset_us, "dur": (end - start) * 1e6} for start, end in transfers]


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace, written by `profile_generation` or gzipped (as results/gpu keeps them)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return json.loads(text)["traceEvents"]


def intervals(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _subtract(intervals: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Both sorted and disjoint: the parts of `intervals` outside every hole (one sweep over both)."""
    out, h = [], 0
    for start, end in intervals:
        while h < len(holes) and holes[h][1] <= start:
            h += 1
        i = h
        while i < len(holes) and holes[i][0] < end:
            a, b = holes[i]
            if a > start:
                out.append((start, a))
            start = max(start, b)
            i += 1
        if start < end:
            out.append((start, end))
    return out


def _covered(interval: tuple[float, float], union: list[tuple[float, float]], union_ends: list[float]) -> float:
    """How much of `interval` the sorted, disjoint `union` covers (`union_ends`: their ends, for bisect)."""
    start, end = interval
    covered = 0.0
    for a, b in union[bisect.bisect_right(union_ends, start):]:
        if a >= end:
            break
        covered += min(end, b) - max(start, a)
    return covered


def _is_collective_op(name: str) -> bool:
    """Launching or waiting for a collective is not compute (wait_tensor blocks until the data is in).
    `ladder::` ops are the compiled forms: emulated launch and wait, and wait_tensor after a tensor."""
    return name.startswith(("_c10d_functional::", "c10d::", "PythonSubclass", "ladder::")) or name == SYNC_MARKER


def link_overlap(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Communication time in the trace, and the share of it during which compute ran.

    Compute: kernels other than the communication ones when the trace has GPU kernels, else the
    operators of the thread that issued the collectives (launching and waiting for a collective are
    not compute). None if the trace shows no communication."""
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    if kernels:
        link, compute = _split(kernels, lambda e: any(k in e.get("name", "") for k in _CUDA_LINK_KERNELS))
        compute_union = union(intervals(compute))
    else:
        link = [e for e in complete if e.get("cat") == "link" or e.get("name", "").startswith(_GLOO_WORK)]
        marker = next((e for e in complete if e.get("name") == SYNC_MARKER), None)  # the issuing thread
        ops = [e for e in complete if e.get("cat") in ("cpu_op", "user_annotation")
               and (marker is None or e.get("tid") == marker.get("tid"))]
        collective, compute = _split(ops, lambda e: _is_collective_op(e.get("name", "")))
        # what runs inside a collective's launch or wait (copies, its own ops) is not compute
        compute_union = _subtract(union(intervals(compute)), union(intervals(collective)))
    if not link:
        return None
    link_intervals = intervals(link)
    union_ends = [b for _, b in compute_union]
    link_us = sum(end - start for start, end in link_intervals)
    overlapped_us = sum(_covered(i, compute_union, union_ends) for i in link_intervals)
    return {"link_events": len(link), "link_s": link_us / 1e6, "overlapped_s": overlapped_us / 1e6,
            "overlap_fraction": overlapped_us / link_us if link_us > 0 else None}


def _split(events: list[dict[str, Any]], is_first: Callable[[dict[str, Any]], bool]
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    first, rest = [], []
    for e in events:
        (first if is_first(e) else rest).append(e)
    return first, rest
