"""Reading `ladder bench` results back: which records compare (`group_key`), every layout's speedup
over standard, and for ladder the fraction of communication hidden with its bootstrap interval
(`summarise`), and the summary table (`format_summary`). Needs no torch: it reads JSON lines."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ladder.errors import LadderError
from ladder.options import DecodeStep


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 (linear between the closest ranks) and n; None for no values. Every
    latency ladder reports (bench's decode steps, bench serve's TTFT, ITL and end-to-end) uses this."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else list(values) * 99
    return {"mean": statistics.fmean(values), "p50": q[49], "p90": q[89], "p99": q[98], "n": len(values)}


def read_results(path: Path) -> list[dict[str, Any]]:
    """Every record of a results file, in the order measured (failed configurations included)."""
    return [record for _, record in json_lines(path)]


# What the summary and the pictures read from every record, and from every successful one.
RECORD_FIELDS = ("status", "preset", "layout", "interconnect", "tp", "batch_size", "prompt_len", "gen_len")
MEASURED_FIELDS = ("tokens_per_s",)


def read_bench_files(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """`read_bench_records` of several files, in order: their runs pool as one file's would."""
    return [record for path in paths for record in read_bench_records(Path(path))]


def read_bench_records(path: Path) -> list[dict[str, Any]]:
    """`read_results`, refusing in one line a file that is not `ladder bench`'s (a training run's
    metrics.jsonl, say) rather than failing on the first field it lacks."""
    records = []
    for n, record in json_lines(path):
        needed = RECORD_FIELDS + (MEASURED_FIELDS if isinstance(record, dict) and record.get("status") == "ok"
                                  else ())
        missing = [name for name in needed if not isinstance(record, dict) or name not in record]
        if missing:
            raise LadderError(f"{path}:{n} is not a ladder bench record (it has no {', '.join(missing)})")
        records.append(record)
    return records


def json_lines(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-blank line."""
    if not path.is_file():
        raise LadderError(f"no results file at {path}")
    text = path.read_text()
    records = []
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((n, json.loads(line)))
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):
                continue  # the last record of a killed run, cut short while being written: not a result
            raise LadderError(f"{path}:{n} is not a JSON line") from None
    return records


def decode_step(r: dict[str, Any]) -> str:
    """How a record's decode step ran (`DecodeStep`'s label). Steps run differently are not comparable:
    they are never pooled or drawn together."""
    return DecodeStep.of_record(r).value


def group_key(r: dict[str, Any]) -> tuple:
    """Results comparable with each other: same model, link, TP, batch, lengths, device, dtype and
    decode step."""
    dilation = ("share", r["comm_share"]) if r.get("comm_share") is not None else r.get("link_scale", 1.0)
    return (r["preset"], r["interconnect"], dilation, r["tp"], r["batch_size"],
            r["prompt_len"], r["gen_len"], r.get("device"), device_name(r), r.get("dtype"), r.get("quantize"), decode_step(r))


def device_name(r: dict[str, Any]) -> str | None:
    """The processor a record was measured on, as torch names it (an H100 and an H200 never pool)."""
    return (r.get("env") or {}).get("device_name")


# What a file's rows are told apart by only when its records differ in it (a sweep run again in
# bfloat16, or on another GPU, into the same file); a file measured one way shows neither.
TOLD_APART_BY = ("device_name", "dtype", "quantize")


def link_label(r: dict[str, Any]) -> str:
    """The interconnect as results show it: `real`, or `pcie-no-p2p x10 (emulated)` (x: the dilation),
    or `pcie-no-p2p 25% of step (emulated)` for a link dilated to a share (`--comm-share`), whose
    dilation differs by batch size and by day."""
    if not r.get("emulated"):
        return r["interconnect"]
    if r.get("comm_share") is not None:
        return f"{r['interconnect']} {r['comm_share']:.0%} of step (emulated)"
    scale = r.get("link_scale", 1.0)
    return f"{r['interconnect']}{f' x{scale:.3g}' if scale != 1 else ''} (emulated)"


def layout_label(r: dict[str, Any]) -> str:
    if r["layout"] == "ladder" and r.get("ladder_layers") is not None:
        return f"ladder[{r['ladder_layers']}]"
    return r["layout"]


def summarise(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per comparable group: every layout's speedup over standard, and for ladder the fraction of
    communication hidden, (t_standard - t_ladder) / (t_standard - t_upper_bound).

    Records of one configuration (several `--rounds`, or a sweep run again into the same file) are
    pooled: a layout's throughput is the median over all its measured runs."""
    pooled: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        if r.get("status") == "ok":
            pooled.setdefault(group_key(r), {}).setdefault(layout_label(r), []).append(r)
    rows = []
    for key, by_layout in pooled.items():
        tps = {label: pooled_tokens_per_s(rs) for label, rs in by_layout.items()}
        for label, rs in by_layout.items():
            row = {"preset": key[0], "interconnect": key[1], "link": link_label(rs[0]), "emulated": rs[0]["emulated"],
                   "comm_share": rs[0].get("comm_share"), "device_name": device_name(rs[0]),
                   "dtype": rs[0].get("dtype"), "quantize": rs[0].get("quantize"),
                   "decode_step": key[-1], "tp": key[3], "batch_size": key[4], "layout": label,
                   "tokens_per_s": tps[label], "records": len(rs), "speedup": None, "hidden": None, "hidden_in_run": _pooled_in_run(rs)}
            if "standard" in tps:
                row["speedup"] = tps[label] / tps["standard"]
                if label.startswith("ladder") and "upper-bound" in tps and key[3] > 1:  # TP 1: nothing to hide
                    triple = [by_layout[name] for name in ("standard", label, "upper-bound")]
                    row["communication_share"] = 1 - tps["standard"] / tps["upper-bound"]
                    row["hidden"] = pooled_hidden(triple)
                    row["hidden_rounds"] = _hidden_per_round(triple)
                    row["hidden_interval"] = hidden_interval(triple)
            rows.append(row)
    varying = [field for field in TOLD_APART_BY if len({row[field] for row in rows}) > 1]
    for row in rows:
        row["told_apart_by"] = ", ".join(str(row[field]) for field in varying)
    rows.sort(key=lambda r: (r["preset"], r["link"], str(r["device_name"]), str(r["dtype"]), str(r["quantize"]), r["decode_step"],
                             r["tp"], r["batch_size"], layout_order(r["layout"])))
    return rows


def layout_order(label: str) -> tuple[int, int, str]:
    """Sort key of a layout label: standard, parallel, hybrids by N (ladder[3] before ladder[12]), whole
    ladder, desync, upper bound."""
    order = {"standard": 0, "parallel": 1, "ladder": 2, "desync": 3, "upper-bound": 4}
    name, _, n = label.partition("[")
    return order.get(name, 9), int(n.rstrip("]")) if n.rstrip("]").isdigit() else 1 << 30, label


def failures(records: Sequence[dict[str, Any]]) -> list[str]:
    """A line for each failed configuration no later record measured (what the summary table lacks, and
    why), its layouts that failed alike on one line."""
    def measurement(r: dict[str, Any]) -> tuple:  # without env: a failed record has none, so no device_name
        return group_key({**r, "env": None}), layout_label(r), r.get("round", 0)

    measured = {measurement(r) for r in records if r.get("status") == "ok"}
    failed: dict[tuple, list[str]] = {}
    for r in records:
        if r.get("status") == "ok" or measurement(r) in measured:
            continue
        where = (r["preset"], link_and_step(link_label(r), decode_step(r)), r["tp"], r["batch_size"],
                 r.get("error", "no reason given"))
        if layout_label(r) not in failed.setdefault(where, []):
            failed[where].append(layout_label(r))
    return [f"failed: {preset} {link} tp={tp} batch {batch} ({', '.join(layouts)}): {error}"
            for (preset, link, tp, batch, error), layouts in failed.items()]


def pooled_tokens_per_s(records: Sequence[dict[str, Any]]) -> float:
    """The median over every measured run of records of one layout and configuration."""
    return statistics.median(x for r in records for x in r.get("tokens_per_s_runs") or [r["tokens_per_s"]])


def hidden_fraction(t_standard: float, t_ladder: float, t_upper_bound: float) -> float | None:
    """The share of standard's communication time that ladder hides; None when there is none to hide."""
    if t_standard <= t_upper_bound:
        return None
    return (t_standard - t_ladder) / (t_standard - t_upper_bound)


def pooled_hidden(layouts: Sequence[Sequence[dict[str, Any]]]) -> float | None:
    """The whole-run hidden fraction of one configuration from the records of standard, ladder and upper
    bound (in that order), every run pooled. When the layouts took turns (`--interleave`), run i of
    each shared the machine's moment, so t is each layout's total time over the turns they all had:
    paired, drift cancels. Otherwise t is each layout's median run. (Medians of layouts that took
    turns would pick different turns and lose the pairing, worst when runs at different speeds pool.)"""
    runs = [_runs_by_turn(records) for records in layouts]
    return _hidden_of_turns(runs, _paired(layouts, runs), None)


def _paired(layouts: Sequence[Sequence[dict[str, Any]]], runs: Sequence[dict[tuple, float]]) -> bool:
    """Whether the three layouts' runs (`_runs_by_turn` of each) were measured turn by turn together,
    and so can be paired."""
    return (all(r.get("interleaved") for records in layouts for r in records)
            and runs[0].keys() == runs[1].keys() == runs[2].keys())


def _hidden_of_turns(runs: Sequence[dict[tuple, float]], paired: bool,
                     picks: Sequence[Sequence[tuple]] | None) -> float | None:
    """`pooled_hidden` of the runs (tokens/s by turn) picked for each layout (all of them: None)."""
    picked = [list(r) for r in runs] if picks is None else picks
    if paired:  # time is tokens / (tokens/s), and every run has the same tokens: 1 / (tokens/s) will do
        seconds = [sum(1.0 / r[turn] for turn in pick) for r, pick in zip(runs, picked)]
    else:
        seconds = [1.0 / statistics.median(r[turn] for turn in pick) for r, pick in zip(runs, picked)]
    return hidden_fraction(*seconds)


def _hidden_per_round(layouts: Sequence[Sequence[dict[str, Any]]]) -> list[float]:
    """`pooled_hidden` of each round on its own (its spread shows what pooling resolves); empty unless
    there are several rounds."""
    rounds = sorted({_round_key(r) for r in layouts[1]}, key=str)
    out = []
    for i in rounds if len(rounds) > 1 else []:
        mine = [[r for r in records if _round_key(r) == i] for records in layouts]
        if all(mine) and (h := pooled_hidden(mine)) is not None:
            out.append(h)
    return out


def _round_key(r: dict[str, Any]) -> tuple[int, str | None]:
    """Which round a record was measured in. Layouts that took turns share their group (`_group_of`),
    which keeps apart the rounds of sweeps pooled from several files (each numbers its rounds from 0)."""
    return r.get("round", 0), _group_of(r) if r.get("interleaved") else None


HIDDEN_CONFIDENCE = 0.95


def hidden_interval(layouts: Sequence[Sequence[dict[str, Any]]], resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float] | None:
    """A 95 % percentile-bootstrap interval of `pooled_hidden`: how far the noise of the measured runs
    leaves the figure uncertain. Runs of layouts that took turns are resampled as triples (they shared
    the machine's drift); otherwise each layout's runs are resampled on their own. Deterministic (a
    fixed seed)."""
    runs = [_runs_by_turn(records) for records in layouts]
    if not all(runs):
        return None
    paired = _paired(layouts, runs)
    rng = random.Random(seed)
    turns = [sorted(r) for r in runs]
    estimates = []
    for _ in range(resamples):
        if paired:
            drawn = rng.choices(turns[0], k=len(turns[0]))
            picks = [drawn] * 3
        else:
            picks = [rng.choices(t, k=len(t)) for t in turns]
        if (h := _hidden_of_turns(runs, paired, picks)) is not None:
            estimates.append(h)
    if len(estimates) < resamples / 2:  # communication indistinguishable from noise: no interval to give
        return None
    estimates.sort()
    tail = (1 - HIDDEN_CONFIDENCE) / 2
    return estimates[int(tail * (len(estimates) - 1))], estimates[math.ceil((1 - tail) * (len(estimates) - 1))]


def _group_of(r: dict[str, Any]) -> str | None:
    """The set of workers a record was measured in: layouts that took turns share it. (Records before
    `interleaved.group` existed fall back to their start time, which can differ by a second.)"""
    return (r.get("interleaved") or {}).get("group") or r.get("env", {}).get("time")


def _runs_by_turn(records: Sequence[dict[str, Any]]) -> dict[tuple[int, str | None, int], float]:
    """tokens/s of each measured run, keyed by the turn it was measured in: (round, its group of workers
    (a sweep run twice into one file repeats the rounds), run index)."""
    return {(r.get("round", 0), _group_of(r), i): x for r in records
            for i, x in enumerate(r.get("tokens_per_s_runs") or [r["tokens_per_s"]])}


def _pooled_in_run(records: list[dict[str, Any]]) -> float | None:
    """1 - exposed / modelled communication over every measured run of an emulated configuration."""
    measured = [r for r in records if r.get("hidden_in_run") is not None and r.get("modelled_comm_s_per_run")]
    modelled = sum(r["modelled_comm_s_per_run"] for r in measured)
    return 1.0 - sum(r["exposed_comm_s_per_run"] for r in measured) / modelled if modelled else None


def _summary_cells(r: dict[str, Any]) -> tuple[str, str, str, str, str, str]:
    speed = f"{r['speedup']:.3f}" if r["speedup"] is not None else "-"
    hidden = f"{r['hidden']:.2f}" if r["hidden"] is not None else ""
    interval = r.get("hidden_interval")
    confidence = f"{interval[0]:.2f}..{interval[1]:.2f}" if interval else ""
    rounds = r.get("hidden_rounds") or []
    spread = f"{min(rounds):.2f}..{max(rounds):.2f}" if rounds else ""
    in_run = f"{r['hidden_in_run']:.2f}" if r.get("hidden_in_run") is not None else ""
    cell = link_and_step(r["link"], r.get("decode_step", "eager"), r.get("told_apart_by", ""))
    return cell, speed, hidden, confidence, spread, in_run


def link_and_step(link: str, step: str, told_apart_by: str = "") -> str:
    """The interconnect column: the link, how the decode step ran unless eagerly, and the device or
    dtype where the file's records differ in them."""
    return ", ".join(part for part in (link, "" if step == "eager" else step, told_apart_by) if part)


def format_summary(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """`hidden`: from whole runs, (t_standard - t) / (t_standard - t_upper_bound), every round pooled;
    `95% CI`: its bootstrap interval over the measured runs (`hidden_interval`); `rounds`: the lowest
    and highest of it over the rounds taken one by one; `in run`: measured inside each emulated run,
    the share of the modelled communication that was over before compute needed it."""
    if markdown:
        lines = ["| interconnect | tp | batch | layout | tokens/s | speedup | hidden | 95% CI | rounds "
                 "| hidden in run |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            link, speed, hidden, confidence, spread, in_run = _summary_cells(r)
            lines.append(f"| {link} | {r['tp']} | {r['batch_size']} | {r['layout']} | {r['tokens_per_s']:.1f} | "
                         f"{speed} | {hidden} | {confidence} | {spread} | {in_run} |")
        return "\n".join(lines + [f"\n{note}" for note in little_to_hide(rows)])
    width = max([14] + [len(r["preset"]) + 2 for r in rows])
    link_width = max([28] + [len(_summary_cells(r)[0]) + 1 for r in rows])
    batch_width = batch_column_width(rows)
    header = (f"{'preset':<{width}}{'interconnect':<{link_width}}{'tp':>3}{'batch':>{batch_width}}  {'layout':<12}{'tokens/s':>10}"
              f"{'speedup':>9}{'hidden':>8}{'95% CI':>14}{'rounds':>14}{'in run':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        link, speed, hidden, confidence, spread, in_run = _summary_cells(r)
        lines.append(f"{r['preset']:<{width}}{link:<{link_width}}{r['tp']:>3}{r['batch_size']:>{batch_width}}  {r['layout']:<12}"
                     f"{r['tokens_per_s']:>10.1f}{speed:>9}{hidden:>8}{confidence:>14}{spread:>14}{in_run:>8}")
    return "\n".join(lines + little_to_hide(rows))


def batch_column_width(rows: list[dict[str, Any]]) -> int:
    """Wide enough that the batch never runs into the TP column before it (a batch of 100000 would)."""
    return max([6] + [len(str(r["batch_size"])) + 1 for r in rows])


SMALL_COMMUNICATION_SHARE = 0.05  # of standard's time: below it, t_standard - t_upper_bound is within run-to-run noise


def little_to_hide(rows: list[dict[str, Any]]) -> list[str]:
    """A note for each ladder row whose hidden fraction cannot be judged: communication is a small share
    of standard's time (1 - t_upper_bound / t_standard), so the fraction divides noise by a small
    difference and compute dominates the comparison; or upper bound measured no faster than standard,
    so there was nothing to see hidden and the cell is blank."""
    notes = []
    for r in rows:
        share = r.get("communication_share")  # set on ladder rows measured beside both baselines
        if share is None or (r["hidden"] is not None and share >= SMALL_COMMUNICATION_SHARE):
            continue
        undilated = r["emulated"] and r["comm_share"] is None
        remedy = ("dilate the emulated link to measure it (--comm-share 0.25)" if undilated
                  else "measure more runs, in turns (--interleave steps --rounds 3)")
        where = f"note: {r['preset']} {r['link']} tp={r['tp']} batch {r['batch_size']}"
        if r["hidden"] is None:
            notes.append(f"{where}: upper bound measured no faster than standard, so no communication was seen "
                         f"to hide; {remedy}")
        else:
            notes.append(f"{where}: communication is {share:.1%} of standard's time, so the hidden fraction "
                         f"there is mostly noise; {remedy}")
    return notes
