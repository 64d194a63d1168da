"""Running a sweep: every configuration (or group of layouts measured together) in fresh worker
processes, round after round, each record appended as soon as it is measured; `--resume` skips what
a results file holds already."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from ladder.bench.records import SCHEMA_VERSION, append_jsonl, check_results_file, point_key
from ladder.bench.spec import BenchPoint, check_repetition, interleaved_groups
from ladder.bench.summary import layout_label
from ladder.bench.worker import RanksDisagree, bench_on_rank
from ladder.comm.distributed import init_distributed, shutdown_distributed
from ladder.comm.launch import launch, under_torchrun
from ladder.console import is_rank0
from ladder.errors import LadderError

Records = dict[str, dict[str, Any]]  # records by `point_key`


def run_group(group: Sequence[BenchPoint], interleave: str = "runs") -> list[dict[str, Any]]:
    """Measure one configuration, or several measured together, in fresh worker processes; a failure
    becomes a `failed` record for each of them."""
    first = group[0]
    nproc = 1 if first.emulated else first.tp
    try:
        if under_torchrun() and first.emulated:
            results = bench_on_rank(group, interleave)  # every rank measures its own copy; rank 0 reports
        else:
            results = launch(bench_on_rank, nproc, group, interleave, isolate=True, device=first.device).get(0)
    except RanksDisagree:
        raise  # every configuration after this one would be mismatched too
    except LadderError as exc:
        return [{"schema": SCHEMA_VERSION, "status": "failed", "error": str(exc), **p.describe()} for p in group]
    return results or []  # nothing on a non-zero rank under torchrun


def agree_on_measured_already(done: Records, points: Sequence[BenchPoint]) -> Records:
    """Under torchrun, rank 0's `--resume` records for every rank: the others read the file on their own
    machines (absent, or another run's), so they would skip other configurations than rank 0 does."""
    init_distributed(points[0].device)
    box = [done]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_sweep(points: list[BenchPoint], out: Path, progress: bool = True, rounds: int = 1,
              interleave: str | None = None, done: Records | None = None) -> list[dict[str, Any]]:
    """Measure every point, `rounds` times over: round-robin, so that a slow spell of a shared machine
    hits every layout alike instead of biasing whichever configuration ran during it. `interleave`:
    "runs" or "steps": the layouts of a configuration share one set of workers and take turns run by
    run or step by step (finer still).
    `done` (`measured_already(out)`, to resume): points (and rounds) with a record there are not
    measured again; their records are returned with the new ones (an interrupted sweep, or one cut
    into time-limited jobs)."""
    check_repetition(rounds, interleave)
    is_main = is_rank0()
    if is_main:
        check_results_file(out)
    points = [p.with_dtype_resolved() for p in points]
    done = done or {}
    records: list[dict[str, Any]] = []
    groups = interleaved_groups(points) if interleave else [[p] for p in points]
    bar = tqdm(total=rounds * len(points), desc="bench", unit="config", disable=not (progress and is_main),
               dynamic_ncols=True)
    try:
        if under_torchrun() and any(not p.emulated for p in points):
            done = agree_on_measured_already(done, points)
        for i in range(rounds):
            for group in groups:
                keys = [point_key(p.describe(), i) for p in group]
                if all(k in done for k in keys):
                    records.extend(done[k] for k in keys)
                else:
                    first, layouts = group[0], "+".join(layout_label(p.describe()) for p in group)
                    bar.set_postfix_str(f"{first.preset} {layouts} tp={first.tp} bs={first.batch_size} "
                                        f"{first.interconnect}" + (f" round {i + 1}/{rounds}" if rounds > 1 else ""))
                    records += _measure_group(group, i, interleave or "runs", out, done, bar if is_main else None)
                bar.update(len(group))
    finally:
        bar.close()
        if under_torchrun():
            shutdown_distributed()  # the one group of the sweep (see bench_on_rank)
    return records


def _measure_group(group: Sequence[BenchPoint], round_: int, interleave: str, out: Path, done: Records,
                   bar: tqdm | None) -> list[dict[str, Any]]:
    """Measure one group and append its new records to `out`; returns them (rank 0; nothing elsewhere)."""
    records = []
    for record in run_group(group, interleave):
        if bar is None:
            continue
        record["round"] = round_
        earlier = done.get(point_key(record, round_))
        if earlier is not None:  # a group measured again for a layout of it that failed
            records.append(earlier)
            continue
        append_jsonl(out, record)
        records.append(record)
        if record["status"] != "ok":
            bar.write(f"failed: {layout_label(record)} tp={record['tp']} bs={record['batch_size']}: {record['error']}")
    return records
