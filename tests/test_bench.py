"""ladder bench: a short real + emulated sweep, the emulated link's timing, failures kept in the file."""

import dataclasses
import json
import re
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ladder.bench import records, summary, worker
from ladder.bench.calibrate import _standard_step_times
from ladder.bench.records import measured_already
from ladder.bench.spec import BenchPoint, sweep_points
from ladder.bench.summary import failures, format_summary, layout_label, read_results, summarise
import ladder.bench.sweep as bench_sweep
from ladder.bench.sweep import run_sweep
from ladder.comm.emulated import EmulatedCommunicator, wait_until
from ladder.comm.links import LinkModel, get_link
from ladder.errors import LadderError
from ladder.model.config import get_preset
from ladder.options import DecodeStep
from ladder.runtime.memory import estimate_memory_bytes

from helpers import ladder_in_fixture, ladder_in_process, ladder_lines, torchrun_ladder, torchrun_on_two_nodes

REQUIRED = {"layout", "preset", "model", "tp", "batch_size", "prompt_len", "gen_len", "interconnect", "emulated",
            "env", "prefill_s", "decode_s", "tokens_per_s", "decode_token_latency_ms", "peak_memory_bytes",
            "achieved_bandwidth_gbps", "dtype"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.jsonl"
    args = ["--preset", "tiny", "--layouts", "standard,ladder,upper-bound", "--tp", "1,2", "--batch-sizes", "2",
            "--prompt-len", "8", "--gen-len", "4", "--warmup", "1", "--runs", "2", "--no-progress"]
    real = ladder_in_fixture("bench", *args, "--interconnect", "real", "--out", str(out))
    emulated = ladder_in_fixture("bench", *args, "--interconnect", "custom", "--link-latency-us", "300",
                                 "--link-bandwidth-gbps", "1", "--rounds", "2", "--out", str(out))
    assert real.returncode == 0, real.stderr
    assert emulated.returncode == 0, emulated.stderr
    return out, real.stdout + emulated.stdout


def test_results_file_is_well_formed(sweep):
    out, stdout = sweep
    records = read_results(out)
    assert len(records) == 18  # appended: 3 layouts x 2 TP, real once and emulated in 2 rounds
    for r in records:
        assert r["status"] == "ok", r
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["tokens_per_s"] > 0 and r["decode_token_latency_ms"]["p50"] > 0
        # medians of the measured runs: both views of throughput lie within the runs' range (exactly, on any load)
        runs = r["tokens_per_s_runs"]
        assert len(runs) == 2 and min(runs) <= r["tokens_per_s"] <= max(runs)
        assert min(runs) * 0.999 <= r["batch_size"] * r["gen_len"] / r["total_s"] <= max(runs) * 1.001
    for r in records:  # the machine of every rank of a real link (one rank per emulated configuration)
        assert r["env"].get("rank_hosts") == (None if r["emulated"] else [socket.gethostname()] * r["tp"])
    emulated = [r for r in records if r["emulated"]]
    assert len(emulated) == 12 and all(r["interconnect"] == "custom" for r in emulated)
    assert [r["round"] for r in emulated] == [0] * 6 + [1] * 6  # interleaved: every configuration, then again
    for r in emulated:  # measured inside each run: a share of the modelled communication
        assert 0 <= r["exposed_comm_s_per_run"] <= r["modelled_comm_s_per_run"] + 1e-9
        assert r["hidden_in_run"] == pytest.approx(1 - r["exposed_comm_s_per_run"] / r["modelled_comm_s_per_run"]) \
            if r["modelled_comm_s_per_run"] else r["hidden_in_run"] is None
    assert {r["all_reduces_per_run"] for r in emulated if r["tp"] == 2 and r["layout"] != "upper-bound"} == {4 * 8}  # (prefill + 3 decode steps) x 2 per layer x 4 layers
    assert "speedup" in stdout and "(emulated)" in stdout


def test_summary_speedups_and_hidden_fraction(sweep, capsys):
    rows = summarise(read_results(sweep[0]))
    ladder = [r for r in rows if r["layout"] == "ladder" and r["tp"] == 2]
    assert len(ladder) == 2 and all(r["speedup"] is not None for r in ladder)
    # 300 us a message on the emulated link: standard is surely slower than the upper bound. (Over real gloo
    # between two processes on two cores, noise may reverse them, and then there is nothing to judge.)
    assert all(r["hidden"] is not None for r in ladder if r["emulated"])
    assert all(r["speedup"] == 1.0 for r in rows if r["layout"] == "standard")
    # The command pools the files it is given (here one file twice: the same runs, the same table).
    once, twice = (ladder_in_process(capsys, "bench", "summary", *[str(sweep[0])] * n) for n in (1, 2))
    assert once.returncode == twice.returncode == 0 and once.stdout == twice.stdout and "95% CI" in once.stdout
    as_json = ladder_in_process(capsys, "bench", "summary", "--json", str(sweep[0]))
    assert as_json.returncode == 0 and [json.loads(line) for line in as_json.stdout.splitlines()] == \
        json.loads(json.dumps(rows))  # the rows themselves, one object each (tuples read back as lists)
    missing = ladder_in_process(capsys, "bench", "summary", str(sweep[0]), str(sweep[0].with_name("none.jsonl")))
    assert missing.returncode == 2 and missing.stderr.strip().endswith("none.jsonl")


@pytest.mark.parametrize("command", ["summary", "plot"])
@pytest.mark.parametrize("text,message", [
    ('{"step": 10, "loss": 3.2}\n', "r.jsonl:1 is not a ladder bench record (it has no status, preset, layout"),
    ('{"status": "ok", "preset": "tiny"}\n', "(it has no layout, interconnect, tp, batch_size, prompt_len, gen_len, "
                                             "tokens_per_s)"),
    ('\n[1, 2]\n', "r.jsonl:2 is not a ladder bench record"),
    ('{"status": "ok"\n{}\n', "r.jsonl:1 is not a JSON line"),
])
def test_a_file_that_is_not_a_results_file_is_refused_in_one_line(command, text, message, tmp_path, capsys):
    """A training run's metrics.jsonl given by mistake, say: one line naming the file, not a traceback."""
    (tmp_path / "r.jsonl").write_text(text)
    out = ladder_in_process(capsys, "bench", command, str(tmp_path / "r.jsonl"))
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert message in out.stderr


def test_summary_pools_rounds():
    def record(layout, runs, round_):
        return {"status": "ok", "preset": "tiny", "interconnect": "custom", "emulated": True, "link_scale": 1.0,
                "tp": 2, "batch_size": 2, "prompt_len": 8, "gen_len": 4, "layout": layout, "round": round_,
                "tokens_per_s": sorted(runs)[len(runs) // 2], "tokens_per_s_runs": runs}

    records = [record("standard", [10, 10], 0), record("ladder", [12, 14], 0), record("upper-bound", [20, 20], 0),
               record("standard", [10, 11], 1), record("ladder", [20, 19, 18], 1), record("upper-bound", [20, 21], 1)]
    rows = {r["layout"]: r for r in summarise(records)}
    assert rows["ladder"]["records"] == 2 and rows["ladder"]["tokens_per_s"] == 18  # median of all 5 runs
    assert rows["ladder"]["speedup"] == pytest.approx(18 / 10)
    t_std, t_lad, t_ub = 8 / 10, 8 / 18, 8 / 20  # batch x gen_len / tokens/s
    assert rows["ladder"]["hidden"] == pytest.approx((t_std - t_lad) / (t_std - t_ub))

    def hidden(std, lad, ub):  # from each round's own medians
        return (8 / std - 8 / lad) / (8 / std - 8 / ub)

    assert rows["ladder"]["hidden_rounds"] == pytest.approx([hidden(10, 13, 20), hidden(10.5, 19, 20.5)])
    lo, hi = rows["ladder"]["hidden_interval"]
    assert lo <= rows["ladder"]["hidden"] <= hi and hi - lo > 0.1  # runs this far apart leave it uncertain
    assert f"{lo:.2f}..{hi:.2f}" in format_summary(list(rows.values()))


def test_a_file_measured_in_two_dtypes_or_on_two_devices_is_never_pooled_and_says_which_is_which():
    def record(layout, tokens_per_s, dtype="float32", device="NVIDIA H100 80GB HBM3"):
        return {"status": "ok", "preset": "tiny", "interconnect": "real", "emulated": False, "tp": 1,
                "batch_size": 1, "prompt_len": 8, "gen_len": 4, "layout": layout, "device": "cuda", "dtype": dtype,
                "tokens_per_s": tokens_per_s, "env": {"device_name": device}}

    one_way = [record("standard", 100.0), record("ladder", 110.0)]
    assert "float32" not in format_summary(summarise(one_way))  # nothing to tell apart: no label
    again = [record("standard", 300.0, "bfloat16"), record("ladder", 300.0, "bfloat16"),
             record("standard", 200.0, device="NVIDIA H200"), record("ladder", 250.0, device="NVIDIA H200")]
    rows = summarise(one_way + again)
    speedups = {(r["told_apart_by"], r["layout"]): r["speedup"] for r in rows}
    assert speedups == {("NVIDIA H100 80GB HBM3, float32", "standard"): 1.0,
                        ("NVIDIA H100 80GB HBM3, float32", "ladder"): pytest.approx(1.1),
                        ("NVIDIA H100 80GB HBM3, bfloat16", "standard"): 1.0,
                        ("NVIDIA H100 80GB HBM3, bfloat16", "ladder"): 1.0,
                        ("NVIDIA H200, float32", "standard"): 1.0,
                        ("NVIDIA H200, float32", "ladder"): 1.25}
    assert "real, NVIDIA H200, float32" in format_summary(rows)


def test_hidden_of_layouts_that_took_turns_compares_their_total_times_over_the_same_turns():
    def record(layout, runs, round_, interleaved=True):
        return {"status": "ok", "preset": "tiny", "interconnect": "custom", "emulated": True, "link_scale": 1.0,
                "tp": 2, "batch_size": 2, "prompt_len": 8, "gen_len": 4, "layout": layout, "round": round_,
                "tokens_per_s": sorted(runs)[len(runs) // 2], "tokens_per_s_runs": runs,
                "env": {"time": f"10:0{round_}:00"}} | ({"interleaved": {"by": "steps"}} if interleaved else {})

    # Three turns, the machine faster in the second: medians per layout would pick different turns.
    runs = {"standard": [10, 14, 9], "ladder": [12, 18, 13], "upper-bound": [13, 17, 12]}
    rows = {r["layout"]: r for r in summarise([record(layout, r, 0) for layout, r in runs.items()])}
    t = {layout: sum(1 / x for x in r) for layout, r in runs.items()}
    assert rows["ladder"]["hidden"] == pytest.approx(
        (t["standard"] - t["ladder"]) / (t["standard"] - t["upper-bound"]))
    medians = {layout: 1 / sorted(r)[1] for layout, r in runs.items()}  # what measured one by one would use
    apart = {r["layout"]: r for r in summarise([record(layout, r, 0, False) for layout, r in runs.items()])}
    assert apart["ladder"]["hidden"] == pytest.approx(
        (medians["standard"] - medians["ladder"]) / (medians["standard"] - medians["upper-bound"]))
    assert abs(rows["ladder"]["hidden"] - apart["ladder"]["hidden"]) > 0.05  # 1.05 against 1.00


def test_hidden_interval_resamples_interleaved_runs_together():
    from ladder.bench.summary import hidden_interval

    # Every turn hides exactly 0.9 of standard's communication, but the machine's speed drifts from
    # turn to turn (x0.7 .. x1.3), as on a busy VM; the layouts took turns, so each turn's drift hit all three.
    drift = [0.7, 1.3, 0.85, 1.15, 1.0, 0.75, 1.25, 0.95]
    t_standard, t_upper = 2.0, 1.0
    t_ladder = t_standard - 0.9 * (t_standard - t_upper)

    def records(t: float, interleaved: bool) -> list[dict]:
        return [{"tokens_per_s_runs": [1 / (t / d) for d in drift], "tokens_per_s": 1.0, "round": 0}
                | ({"interleaved": {"by": "steps"}} if interleaved else {})]

    paired = hidden_interval([records(t, True) for t in (t_standard, t_ladder, t_upper)])
    assert paired == pytest.approx((0.9, 0.9))
    # The same numbers measured one layout after another: the drift is noise, and the interval says so.
    lo, hi = hidden_interval([records(t, False) for t in (t_standard, t_ladder, t_upper)])
    assert lo < 0.8 and hi > 1.0
    assert hidden_interval([records(t, False) for t in (t_standard, t_ladder, t_upper)]) == (lo, hi)  # seeded
    # The records of one group can carry start times a second apart: their group keeps them paired.
    split = [records(t, True)[0] | {"env": {"time": start}, "interleaved": {"by": "steps", "group": "g1"}}
             for t, start in ((t_standard, "10:00:00"), (t_ladder, "10:00:01"), (t_upper, "10:00:01"))]
    assert hidden_interval([[r] for r in split]) == pytest.approx((0.9, 0.9))
    # A sweep run twice into one file repeats its rounds: the turns of each stay apart.
    twice = [records(t_standard, True)[0] | {"env": {"time": start}} for start in ("10:00:00", "10:05:00")]
    assert len(summary._runs_by_turn(twice)) == 2 * len(drift)


def test_the_summary_lists_hybrids_by_their_number_of_ladder_layers():
    records = [{"status": "ok", "preset": "tiny", "interconnect": "real", "emulated": False, "tp": 2, "batch_size": 1,
                "prompt_len": 8, "gen_len": 4, "layout": layout, "ladder_layers": n, "tokens_per_s": 10.0}
               for layout, n in [("upper-bound", None), ("ladder", 12), ("ladder", None), ("ladder", 3),
                                 ("standard", None), ("ladder", 6), ("parallel", None)]]
    assert [r["layout"] for r in summarise(records)] == [
        "standard", "parallel", "ladder[3]", "ladder[6]", "ladder[12]", "ladder", "upper-bound"]


def test_plots_pool_records_as_the_summary_does():
    from ladder.bench.plots import _pooled_points, pareto_frontier

    def record(layout, runs, latency_ms, round_):
        return {"status": "ok", "preset": "tiny", "interconnect": "real", "emulated": False, "tp": 2,
                "batch_size": 1, "prompt_len": 8, "gen_len": 4, "layout": layout, "round": round_,
                "tokens_per_s": sorted(runs)[len(runs) // 2], "tokens_per_s_runs": runs,
                "decode_token_latency_ms": {"p50": latency_ms}, "dtype": "float32", "env": {"device_name": "cpu"}}

    records = [record("standard", [10, 10], 50.0, 0), record("ladder", [12, 14], 40.0, 0),
               record("standard", [10, 11], 52.0, 1), record("ladder", [20, 19, 18], 30.0, 1)]
    [(panel, points)] = _pooled_points(records).items()
    assert panel == ("tiny", "real", 8, 4, "cpu", "float32", "eager")
    summary = {r["layout"]: r["tokens_per_s"] for r in summarise(records)}
    assert {p.layout: p.tokens_per_s for p in points} == summary == {"standard": 10, "ladder": 18}
    assert {p.layout: p.latency_ms for p in points} == {"standard": 51.0, "ladder": 35.0}
    assert pareto_frontier([(1, 1), (2, 3), (3, 2), (4, 4)]) == [(1, 1), (2, 3), (4, 4)]


def test_decode_steps_run_differently_are_never_pooled_or_drawn_together():
    from ladder.bench.plots import _pooled_points

    def record(layout, tokens_per_s, **step):
        return {"status": "ok", "preset": "tiny", "interconnect": "nvlink-h100", "emulated": True, "tp": 8,
                "batch_size": 1, "prompt_len": 8, "gen_len": 4, "layout": layout, "tokens_per_s": tokens_per_s,
                "env": {"device_name": "gpu"}, **step}

    eager = [record("standard", 10.0), record("ladder", 12.0)]
    graphed = [record("standard", 20.0, cuda_graph=True), record("ladder", 30.0, cuda_graph=True)]
    compiled = [record("standard", 40.0, cuda_graph=True, compile_layers=True),
                record("ladder", 52.0, cuda_graph=True, compile_layers=True)]
    rows = summarise(eager + graphed + compiled)
    # (pooled together, they gave one ladder row of 1.4: a median of both steps' runs)
    assert sorted(r["speedup"] for r in rows if r["layout"] == "ladder") == [1.2, 1.3, 1.5]
    assert {(r["decode_step"], r["layout"]): r["speedup"] for r in rows} == {
        ("eager", "standard"): 1.0, ("eager", "ladder"): 1.2, ("CUDA graph", "standard"): 1.0,
        ("CUDA graph", "ladder"): 1.5, ("compiled layers + CUDA graph", "standard"): 1.0,
        ("compiled layers + CUDA graph", "ladder"): 1.3}
    table = format_summary(rows)
    assert "nvlink-h100 (emulated), CUDA graph" in table and "nvlink-h100 (emulated) " in table
    assert "nvlink-h100 (emulated), compiled layers + CUDA graph" in table
    assert sorted(panel[-1] for panel in _pooled_points(eager + graphed + compiled)) == [
        "CUDA graph", "compiled layers + CUDA graph", "eager"]


def test_a_link_dilated_to_a_share_is_one_link_across_batch_sizes_and_days():
    from ladder.bench.plots import _pooled_points

    def record(batch, scale):
        return {"status": "ok", "preset": "tiny", "interconnect": "pcie-no-p2p", "emulated": True, "tp": 4,
                "batch_size": batch, "prompt_len": 8, "gen_len": 4, "layout": "ladder", "link_scale": scale,
                "comm_share": 0.25, "tokens_per_s": 10.0, "env": {"device_name": "cpu"}}

    # (two sweeps at 25 %, calibrated on days when this machine ran at different speeds, pool too)
    records = [record(1, 12.2), record(4, 17.7), record(1, 9.19)]
    [(panel, points)] = _pooled_points(records).items()
    assert "pcie-no-p2p 25% of step (emulated)" in panel and [p.batch_size for p in points] == [1, 4]
    assert [(r["batch_size"], r["records"]) for r in summarise(records)] == [(1, 2), (4, 1)]
    fixed = [dict(record(1, 10.0), comm_share=None), dict(record(4, 25.0), comm_share=None)]
    assert len(_pooled_points(fixed)) == 2  # a fixed dilation is a link of its own


def test_each_hybrid_is_drawn_in_a_colour_of_its_own():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ladder.bench.plots import _draw_speedup, _pooled_points

    def record(layout, tokens_per_s, ladder_layers=None):
        return {"status": "ok", "preset": "tiny", "interconnect": "pcie-no-p2p", "emulated": True, "tp": 2,
                "batch_size": 1, "prompt_len": 8, "gen_len": 4, "layout": layout, "ladder_layers": ladder_layers,
                "tokens_per_s": tokens_per_s, "env": {"device_name": "cpu"}}

    records = [record("standard", 10.0), record("ladder", 13.0), record("ladder", 11.0, 1),
               record("ladder", 12.0, 2), record("upper-bound", 14.0)]
    [(panel, points)] = _pooled_points(records).items()
    fig, ax = plt.subplots()
    _draw_speedup(ax, panel, points)
    colors = {line.get_label(): line.get_color() for line in ax.get_lines() if "tp=" in line.get_label()}
    plt.close(fig)
    assert set(colors) == {"ladder tp=2", "ladder[1] tp=2", "ladder[2] tp=2", "upper-bound tp=2"}
    assert len(set(colors.values())) == 4


def test_plot_files(sweep, tmp_path, capsys):
    out = ladder_in_process(capsys, "bench", "plot", str(sweep[0]), "--out-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    for name in ("throughput.png", "speedup.png", "pareto.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # Several files are pooled as one: the sweep split in two draws the very same pictures, beside the first.
    lines = sweep[0].read_text().splitlines(keepends=True)
    halves = [tmp_path / "split" / "real.jsonl", tmp_path / "emulated.jsonl"]
    halves[0].parent.mkdir()
    halves[0].write_text("".join(lines[:6]))
    halves[1].write_text("".join(lines[6:]))
    split = ladder_in_process(capsys, "bench", "plot", *map(str, halves))
    assert split.returncode == 0, split.stderr
    for name in ("throughput.png", "speedup.png", "pareto.png"):
        assert (halves[0].parent / name).read_bytes() == (tmp_path / name).read_bytes()


def test_a_sweep_of_standard_alone_draws_no_empty_speedup_picture(tmp_path):
    from ladder.bench.plots import plot_bench

    records = [{"status": "ok", "preset": "tiny", "interconnect": "real", "emulated": False, "tp": 1,
                "batch_size": batch, "prompt_len": 8, "gen_len": 4, "layout": "standard", "tokens_per_s": 10.0 * batch,
                "decode_token_latency_ms": {"p50": 5.0}, "env": {"device_name": "cpu"}} for batch in (1, 2)]
    paths, not_drawn = plot_bench(records, tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "pareto.png"]
    assert not_drawn == ["speedup.png not drawn: no layout was measured beside standard at the same TP and batch"]
    ladder = [r | {"layout": "ladder", "tokens_per_s": 12.0} for r in records]
    paths, not_drawn = plot_bench(records + ladder, tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "speedup.png", "pareto.png"] and not not_drawn


def test_hybrids_of_several_depths_get_a_picture_of_speedup_against_ladder_layers(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ladder.bench.plots import _draw_hybrids, _pooled_points, plot_bench

    def record(layout, tokens_per_s, ladder_layers=None):
        return {"status": "ok", "preset": "tiny", "interconnect": "pcie-no-p2p", "emulated": True, "tp": 2,
                "batch_size": 1, "prompt_len": 8, "gen_len": 4, "layout": layout, "ladder_layers": ladder_layers,
                "tokens_per_s": tokens_per_s, "model": {"n_layers": 12}, "env": {"device_name": "cpu"}}

    records = [record("standard", 10.0), record("ladder", 11.0, 3), record("ladder", 12.0, 6), record("ladder", 14.0),
               record("upper-bound", 15.0)]
    [(panel, points)] = _pooled_points(records).items()
    fig, ax = plt.subplots()
    _draw_hybrids(ax, panel, points)
    lines = {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()}
    plt.close(fig)
    assert lines["tp=2 batch 1"] == [[0, 1.0], [3, 1.1], [6, 1.2], [12, 1.4]]  # whole ladder: all 12 layers
    assert lines["upper bound, tp=2 batch 1"][0][1] == 1.5
    paths, _ = plot_bench(records, tmp_path)
    assert paths[-1].name == "hybrid.png"
    paths, _ = plot_bench([r for r in records if r["ladder_layers"] is None], tmp_path)  # one depth: no such picture
    assert "hybrid.png" not in [p.name for p in paths]


# Waits are sleeps on a real clock: a wait overshoots by scheduler latency (tens of microseconds on an
# idle machine, ~2 ms seen on a fully loaded 2-core box, once 8 ms), never undershoots. So each check
# takes the fastest of three tries (noise only adds), with 10 % + 2 ms of slack on waits of ~30 ms,
# while a modelling error (e.g. a missing ring factor, +-30 %) fails every try.
def _close(measured: float, modelled: float) -> bool:
    return modelled <= measured + 1e-4 and measured <= modelled * 1.1 + 2e-3


def _fastest_of_three(timed: Callable[[], None]) -> float:
    """The shortest wall time of three calls of `timed`."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        timed()
        times.append(time.perf_counter() - start)
    return min(times)


def test_emulated_wait_matches_the_link_model():
    link = LinkModel("test", latency_us=20_000.0, bandwidth_gbps=0.5, latency_per_rank_us=1000.0)
    comm = EmulatedCommunicator(link, world_size=4, device=torch.device("cpu"))
    x = torch.zeros(1024, 1024)  # 4 MiB: 20 ms + 2 x 1 ms + 1.5 * 4 MiB / 0.5 GB/s = 34.6 ms
    modelled = link.all_reduce_s(x.numel() * 4, 4)
    assert modelled == pytest.approx(22e-3 + 1.5 * 4 * 2**20 / 0.5e9)
    assert _close(_fastest_of_three(lambda: comm.all_reduce(x)), modelled)


def test_emulated_link_overlaps_compute_and_serialises_collectives():
    link = LinkModel("test", latency_us=20_000.0, bandwidth_gbps=1000.0)
    comm = EmulatedCommunicator(link, world_size=2, device=torch.device("cpu"))
    x = torch.zeros(16)
    d = link.all_reduce_s(64, 2)

    def overlapped() -> None:
        handle = comm.all_reduce_async(x)
        wait_until(time.perf_counter() + 0.6 * d)  # "compute" for 60 % of the all-reduce
        handle.wait()

    def two_in_a_row() -> None:
        first, second = comm.all_reduce_async(x), comm.all_reduce_async(x)
        first.wait()
        second.wait()

    assert _close(_fastest_of_three(overlapped), d)  # hidden: d, not 1.6 d
    assert _close(_fastest_of_three(two_in_a_row), 2 * d)  # one link: the second waits for the first


def test_emulated_link_counts_only_communication_compute_did_not_hide():
    link = LinkModel("test", latency_us=20_000.0, bandwidth_gbps=1000.0)
    comm = EmulatedCommunicator(link, world_size=2, device=torch.device("cpu"))
    x = torch.zeros(16)
    d = link.all_reduce_s(64, 2)
    comm.all_reduce(x)  # waited for at once: all of it exposed
    exposed_first = comm.exposed_s
    handle = comm.all_reduce_async(x)
    time.sleep(1.5 * d)  # "compute" outlasts the transfer: none of it exposed
    handle.wait()
    # Exposure is what was still in flight at wait(), so a slow machine cannot inflate it past d.
    assert 0.75 * d <= exposed_first <= d and comm.exposed_s == exposed_first
    assert comm.hidden_fraction == pytest.approx(1 - exposed_first / (2 * d))


def test_sweep_of_a_real_checkpoint(tiny_hf, tmp_path, capsys):
    _, folder, _ = tiny_hf
    out = tmp_path / "r.jsonl"
    args = ["--model", str(folder), "--tp", "2", "--batch-sizes", "1", "--prompt-len", "4", "--gen-len", "2",
            "--runs", "1", "--no-progress", "--out", str(out)]
    emulated = ladder_in_process(capsys, "bench", *args, "--interconnect", "nvlink-h100")
    real = ladder_in_process(capsys, "bench", *args, "--interconnect", "real", "--layouts", "ladder")
    assert emulated.returncode == 0, emulated.stderr
    assert real.returncode == 0, real.stderr
    assert f"weights of {folder}" in real.stdout
    records = read_results(out)
    # parallel is left out by default: a checkpoint with two norms per layer cannot be converted to it
    assert [(r["interconnect"], r["layout"]) for r in records] == [
        ("nvlink-h100", "standard"), ("nvlink-h100", "ladder"), ("nvlink-h100", "upper-bound"), ("real", "ladder")]
    for r in records:
        assert r["status"] == "ok" and r["weights"] == "checkpoint" and r["checkpoint"] == str(folder)
        assert r["preset"] == folder.name
        assert r["model"]["dim"] == 64 and r["model"]["n_layers"] == 3 and r["model"]["vocab_size"] == 256


def test_a_hybrid_sweep_compares_ladder_on_the_last_layers_with_whole_baselines(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    result = ladder_in_process(capsys, "bench", "--preset", "tiny", "--layouts", "standard,ladder,upper-bound",
                               "--ladder-layers", "2,1", "--tp", "2", "--batch-sizes", "1", "--prompt-len", "4",
                               "--gen-len", "2", "--runs", "1", "--interconnect", "pcie-no-p2p", "--interleave", "steps",
                               "--no-progress", "--out", str(out))
    assert result.returncode == 0, result.stderr
    records = read_results(out)
    assert [(r["layout"], r["ladder_layers"]) for r in records] == [
        ("standard", None), ("ladder", 2), ("ladder", 1), ("upper-bound", None)]
    assert {tuple(r["interleaved"]["layouts"]) for r in records} == {  # one hybrid per N, taking turns with the rest
        ("standard", "ladder[2]", "ladder[1]", "upper-bound")}
    for n in (1, 2):
        assert f"ladder[{n}]" in result.stdout
    # Each hybrid is paired with the one standard and upper bound. Measured seconds are noise at this size
    # (one run of two tokens), so the pairing is checked on set throughputs: t = 1 / (tokens/s).
    set_tokens_per_s = {"standard": 100.0, "ladder[2]": 110.0, "ladder[1]": 105.0, "upper-bound": 120.0}
    for r in records:
        r["tokens_per_s"] = set_tokens_per_s[layout_label(r)]
        r["tokens_per_s_runs"] = [r["tokens_per_s"]]
    rows = {r["layout"]: r for r in summarise(records)}
    for n in (1, 2):
        t_standard, t_hybrid, t_upper = (1 / set_tokens_per_s[k] for k in ("standard", f"ladder[{n}]", "upper-bound"))
        assert rows[f"ladder[{n}]"]["speedup"] == pytest.approx(set_tokens_per_s[f"ladder[{n}]"] / 100.0)
        assert rows[f"ladder[{n}]"]["hidden"] == pytest.approx((t_standard - t_hybrid) / (t_standard - t_upper))


def test_a_sweep_that_measures_nothing_exits_non_zero(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    result = ladder_in_process(capsys, "bench", "--preset", "tiny", "--layouts", "standard", "--tp", "1",
                               "--batch-sizes", "100000000", "--no-progress", "--out", str(out))
    assert result.returncode == 1
    assert "0 configurations measured, 1 failed" in result.stdout
    assert read_results(out)[0]["status"] == "failed"
    summary = ladder_in_process(capsys, "bench", "summary", str(out))
    assert summary.returncode == 2
    assert summary.stderr.strip() == f"ladder: error: no configuration in {out} was measured"
    assert summary.stdout.startswith("failed: tiny real tp=1 batch 100000000 (standard): ") and "GiB" in summary.stdout


def test_the_summary_lists_the_failures_no_later_record_measured():
    def record(layout, batch, status="ok"):  # as written: a failure has no env, so names no device_name
        return {"status": status, "preset": "tiny", "interconnect": "real", "emulated": False, "tp": 2,
                "batch_size": batch, "prompt_len": 8, "gen_len": 4, "layout": layout, "round": 0, "dtype": "float32",
                "tokens_per_s": 10.0, "tokens_per_s_runs": [10.0]} | (
                    {"env": {"device_name": "x86_64"}} if status == "ok" else {"error": "too big"})

    records = [record("standard", 64, "failed"), record("ladder", 64, "failed"), record("ladder", 4, "failed"),
               record("standard", 4), record("ladder", 4)]  # batch 4's ladder measured again, successfully
    assert failures(records) == ["failed: tiny real tp=2 batch 64 (standard, ladder): too big"]
    assert failures(records + [record("standard", 64), record("ladder", 64)]) == []


def test_failed_configuration_is_recorded_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "r.jsonl"
    earlier = {"status": "ok", "preset": "tiny", "layout": "standard", "interconnect": "real", "tp": 1,
               "batch_size": 1, "prompt_len": 4, "gen_len": 2, "tokens_per_s": 9.0, "note": "measured earlier"}
    out.write_text(json.dumps(earlier) + "\n")
    link = get_link("nvlink-h100")
    points = [BenchPoint("llama-3.1-405b", "ladder", tp=8, batch_size=64, prompt_len=1024, gen_len=512, link=link),
              BenchPoint("tiny", "ladder", tp=2, batch_size=1, prompt_len=4, gen_len=2, link=link, runs=1)]
    records = run_sweep(points, out, progress=False)
    assert [r["status"] for r in records] == ["failed", "ok"]
    assert "needs about" in records[0]["error"] and "GiB" in records[0]["error"]
    assert len(read_results(out)) == 3  # earlier results kept, both new ones appended


def test_a_record_is_marked_dirty_by_changed_code_not_by_rewritten_results(tmp_path):
    # A repository laid out like ours: the package under src/, a tracked results file beside it.
    package, results = tmp_path / "src" / "pkg", tmp_path / "results" / "bench.jsonl"
    package.mkdir(parents=True)
    results.parent.mkdir()
    (package / "model.py").write_text("x = 1\n")
    results.write_text("{}\n")

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    clean = records.git_commit(package)
    assert clean and not clean.endswith("-dirty")

    results.unlink()  # what scripts/run.sh does to the committed results: moved aside, then rewritten
    results.write_text('{"status": "ok"}\n')
    assert records.git_commit(package) == clean

    (package / "model.py").write_text("x = 2\n")
    assert records.git_commit(package) == clean + "-dirty"
    git("checkout", "-q", "--", "src")
    (package / "extra.py").write_text("y = 1\n")  # a new module the package may import
    assert records.git_commit(package) == clean + "-dirty"


def test_resume_measures_only_what_is_missing_and_survives_a_cut_line(tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    link = LinkModel("test", latency_us=100.0, bandwidth_gbps=1.0)
    common = dict(tp=2, batch_size=1, prompt_len=4, gen_len=2, link=link, runs=1)
    too_big = BenchPoint("llama-3.1-405b", "ladder", tp=8, batch_size=64, prompt_len=1024, gen_len=512, link=link)
    points = [BenchPoint("tiny", "standard", **common), BenchPoint("tiny", "ladder", **common), too_big]
    first = run_sweep(points[:1] + [too_big], out, progress=False)
    with out.open("a") as f:
        f.write('{"schema": 1, "status": "ok", "layout": "lad')  # a record cut short by a killed run
    measured, run_group = [], bench_sweep.run_group
    monkeypatch.setattr(bench_sweep, "run_group", lambda group, *how: measured.extend(group) or run_group(group, *how))
    again = run_sweep(points, out, progress=False, done=measured_already(out))
    assert [(p.preset, p.layout) for p in measured] == [("tiny", "ladder"), ("llama-3.1-405b", "ladder")]
    assert [r["layout"] for r in again] == ["standard", "ladder", "ladder"]
    assert again[0] == first[0]  # read back, not measured again
    assert [r["status"] for r in again] == ["ok", "ok", "failed"]  # a failure is tried again
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)  # the cut line is gone
    assert run_sweep(points[:2], out, progress=False, done=measured_already(out)) == again[:2]  # nothing left to measure


@pytest.mark.parametrize("args,message", [
    (["--interconnect", "carrier-pigeon"], "unknown interconnect 'carrier-pigeon'"),
    (["--layouts", "standard,zigzag"], "unknown layout 'zigzag'"),
    (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
    (["--tp", "64", "--preset", "llama-3-70b"], "--tp 64 needs 64 processes"),
    (["--interconnect", "custom"], "--interconnect custom needs --link-latency-us and --link-bandwidth-gbps"),
    (["--batch-sizes", "1,x"], "--batch-sizes expects a comma-separated list of ints"),
    (["--runs", "0"], "--runs must be >= 1 and --warmup >= 0, got 0 and 1"),
    (["--warmup", "-1"], "--runs must be >= 1 and --warmup >= 0, got 1 and -1"),
    (["--interconnect", "pcie-no-p2p", "--link-scale", "-2"], "--link-scale must be a positive number, got -2"),
    (["--interconnect", "pcie-no-p2p", "--link-scale", "nan"], "--link-scale must be a positive number, got nan"),
    (["--link-scale", "10"], "--link-scale dilates an emulated link, and --interconnect real has none"),
    (["--link-latency-us", "5"], "--link-latency-us and --link-bandwidth-gbps describe an emulated link"),
    (["--interconnect", "nvlink-h100", "--link-bandwidth-gbps", "0"], "--link-bandwidth-gbps must be > 0, got 0"),
    (["--interconnect", "custom", "--link-latency-us", "-3", "--link-bandwidth-gbps", "10"],
     "--link-latency-us must be >= 0, got -3"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--tp", "1,2,1"], "--tp lists 1 twice"),
    (["--layouts", "ladder,standard,ladder"], "--layouts lists ladder twice"),
    (["--ladder-layers", "1,2", "--layouts", "standard,upper-bound"],
     "--ladder-layers 1,2 makes the ladder layout hybrid, and --layouts standard,upper-bound has no ladder"),
    (["--ladder-layers", "1,1"], "--ladder-layers lists 1 twice"),
    (["--ladder-layers", "1,13"], "ladder_layers must be between 0 and n_layers=12, got 13"),
    (["--profile", "/dev/null"], "--profile /dev/null is a file; name a folder for the traces"),
    (["--device", "tpu"], "unknown device 'tpu'; use cpu, cuda or auto"),
    (["--interconnect", "pcie-no-p2p", "--comm-share", "1.5"], "--comm-share is a share of the step, between 0 and 1"),
    (["--comm-share", "0.25"], "--comm-share dilates an emulated link, and --interconnect real has none"),
    (["--interconnect", "pcie-no-p2p", "--comm-share", "0.25", "--link-scale", "10"],
     "--comm-share and --link-scale both set how far the link is dilated: give one"),
    (["--device", "cpu", "--cuda-graph"], "--cuda-graph needs a CUDA device, and --device cpu is cpu"),
    (["--cuda-graph", "--compile"], "--cuda-graph and --compile both make the decode step a CUDA graph: give one"),
    (["--compile-layers", "--compile"], "--compile compiles the whole decode step and --compile-layers each layer"),
    (["--out", "."], "--out . is a folder; name a file in it, e.g. bench.jsonl"),
    (["--out", "/dev/null/r.jsonl"], "cannot write /dev/null/r.jsonl: /dev/null is a file, not a folder"),
    (["--out", "/proc/r.jsonl"], "cannot write results to /proc/r.jsonl"),  # a folder no one, root included, writes in
])
def test_bad_input_is_one_line(args, message, tmp_path, capsys):
    out = ladder_in_process(capsys, "bench", "--no-progress", "--out", str(tmp_path / "r.jsonl"), "--gen-len", "2",
                     "--prompt-len", "4", "--runs", "1", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert message in lines[0]
    assert out.stdout == ""  # refused before the sweep is announced


@pytest.mark.parametrize("resume", [[], ["--resume"]])
def test_results_are_never_appended_to_a_file_that_is_not_bench_results(resume, tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"  # a training run's, named by mistake
    metrics.write_text('{"step": 1, "tokens": 512, "loss": 9.1}\n')
    out = ladder_in_process(capsys, "bench", "--no-progress", "--preset", "tiny", "--tp", "1", "--batch-sizes", "1",
                     "--layouts", "standard", "--runs", "1", "--out", str(metrics), *resume)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"{metrics}:1 is not a ladder bench record" in out.stderr and "name another file" in out.stderr
    assert metrics.read_text() == '{"step": 1, "tokens": 512, "loss": 9.1}\n'


def test_comm_share_calibration_counts_standards_all_reduces_on_the_undilated_link():
    point = BenchPoint(preset="tiny", layout="ladder", tp=2, batch_size=3, prompt_len=8, gen_len=4,
                       link=get_link("pcie-no-p2p"), link_scale=7.0)
    compute_s, link_s = _standard_step_times(point, steps=4)
    config = point.config()
    per_all_reduce = point.link.all_reduce_s(3 * config.dim * 4, 2)  # batch x dim float32, between 2 ranks
    assert link_s == pytest.approx(2 * config.n_layers * per_all_reduce, rel=1e-6)  # standard's, at scale 1
    assert compute_s > 0


def test_comm_share_dilates_each_configuration_once_and_resume_keeps_its_scale(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    args = ["bench", "--preset", "tiny", "--layouts", "standard,ladder,upper-bound", "--tp", "2",
            "--batch-sizes", "1,2", "--prompt-len", "8", "--gen-len", "4", "--runs", "2", "--rounds", "2",
            "--interconnect", "pcie-no-p2p", "--comm-share", "0.2", "--interleave", "steps", "--no-progress",
            "--out", str(out)]
    first = ladder_in_process(capsys, *args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("--comm-share 0.2: pcie-no-p2p tp=2") == 2  # one calibration per batch size
    records = read_results(out)
    assert len(records) == 12 and {r["comm_share"] for r in records} == {0.2}
    for b in (1, 2):  # every layout and round of a configuration runs on one link
        assert len({r["link_scale"] for r in records if r["batch_size"] == b}) == 1
    # Each configuration runs at the scale its calibration found: link time x scale = share / (1 - share) x
    # compute, as printed (3 significant figures). Whether the measured steps then show that share is a
    # benchmark's question (timed here, it moved with whatever else the machine ran).
    said = re.findall(r"bs=(\d+): x([\d.]+) \(standard's step here: ([\d.]+) ms of compute, ([\d.]+) ms", first.stdout)
    assert len(said) == 2, first.stdout
    for b, scale, compute_ms, link_ms in said:
        assert float(scale) == pytest.approx(0.2 / 0.8 * float(compute_ms) / float(link_ms), rel=0.03)
        assert next(r["link_scale"] for r in records if r["batch_size"] == int(b)) == pytest.approx(float(scale), rel=5e-3)
    again = ladder_in_process(capsys, *args, "--resume")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("as measured before (--resume)") == 2 and "nothing new appended" in again.stdout


def test_unknown_link_in_python_api():
    with pytest.raises(LadderError, match="known: real, custom, nvlink-h100"):
        get_link("token-ring")


def test_interleaved_sweep_takes_turns_with_separate_link_accounts(tmp_path):
    layouts = ["standard", "parallel", "ladder", "upper-bound"]
    link = LinkModel("test", latency_us=300.0, bandwidth_gbps=1.0)
    points = sweep_points(["tiny"], layouts, [2], [2], [None, link], prompt_len=8, gen_len=4, runs=3)
    records = run_sweep(points, tmp_path / "r.jsonl", progress=False, interleave="runs")
    assert [r["status"] for r in records] == ["ok"] * 8 and len(read_results(tmp_path / "r.jsonl")) == 8
    for group in (records[:4], records[4:]):  # real gloo, then the emulated link
        assert [r["layout"] for r in group] == layouts
        assert all(r["interleaved"]["layouts"] == layouts and len(r["tokens_per_s_runs"]) == 3 for r in group)
        for i in range(3):  # each repetition runs every layout once, then the next repetition starts
            assert sorted(r["interleaved"]["turns"][i] for r in group) == list(range(4 * i, 4 * i + 4))
        firsts = [next(r["layout"] for r in group if r["interleaved"]["turns"][i] == 4 * i) for i in range(3)]
        assert len(set(firsts)) == 3  # the order rotates: drift within a repetition favours no layout
    emulated = {r["layout"]: r for r in records[4:]}
    # One link account per layout: counts are each layout's own, not a mix (prefill + 3 decode steps).
    assert emulated["standard"]["all_reduces_per_run"] == 4 * 2 * 4
    assert emulated["parallel"]["all_reduces_per_run"] == 4 * 1 * 4
    assert emulated["upper-bound"]["all_reduces_per_run"] == 0
    assert emulated["ladder"]["hidden_in_run"] > emulated["standard"]["hidden_in_run"]


def test_step_interleaved_sweep_records_each_layouts_own_steps(tmp_path):
    layouts = ["standard", "ladder", "upper-bound"]
    link = LinkModel("test", latency_us=300.0, bandwidth_gbps=1.0)
    points = sweep_points(["tiny"], layouts, [2], [2], [None, link], prompt_len=8, gen_len=4, runs=2)
    records = run_sweep(points, tmp_path / "r.jsonl", progress=False, interleave="steps")
    assert [r["status"] for r in records] == ["ok"] * 6  # real gloo (both ranks step in one order), emulated
    assert all({k: r["interleaved"][k] for k in ("layouts", "by")} == {"layouts": layouts, "by": "steps"}
               for r in records)
    groups = [{r["interleaved"]["group"] for r in part} for part in (records[:3], records[3:])]
    assert all(len(g) == 1 for g in groups) and groups[0] != groups[1]  # one group per configuration
    by_layout = {r["layout"]: r for r in records[3:]}
    assert by_layout["standard"]["all_reduces_per_run"] == 4 * 2 * 4  # its own link account, as by runs
    assert by_layout["upper-bound"]["all_reduces_per_run"] == 0
    assert by_layout["ladder"]["hidden_in_run"] > by_layout["standard"]["hidden_in_run"]
    with pytest.raises(LadderError, match="--interleave takes runs or steps, not 'tokens'"):
        run_sweep(points, tmp_path / "r.jsonl", progress=False, interleave="tokens")


@pytest.fixture
def one_intra_op_thread():
    """Matrix products on the calling thread only. After a long idle wait, torch's intra-op worker
    threads are asleep, and on a loaded machine waking them takes a scheduler slice: beside two busy
    loops, upper bound's 3 steps of the tiny model took up to 93 ms with 2 threads after 25 ms waits,
    and 8 ms with 1 (experiments/investigations/intra_op_wakeup.py; 1 run in 25 of the test below failed with 2 threads
    and 5 ms waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_generations_in_turns_keep_their_own_caches_samples_and_clocks(one_intra_op_thread):
    """Three layouts stepped in turns produce the tokens each produces alone (separate KV caches and
    random streams), and each result times its own steps only: upper bound's decode time excludes
    the 20 ms waits of standard's all-reduces that ran between its steps (24 of them in all; 5 ms waits
    were too short on a loaded machine, where upper bound's 3 tiny steps once took 43 ms)."""
    from ladder.model.config import get_preset
    from ladder.runtime.engine import Engine
    from ladder.runtime.sampling import SamplingParams
    from ladder.model.weights import random_model, share_weights

    cpu = torch.device("cpu")
    link = LinkModel("slow", latency_us=20_000.0, bandwidth_gbps=1.0)
    comms = [EmulatedCommunicator(link, 2, cpu) for _ in range(3)]
    standard = random_model(get_preset("tiny", layout="standard"), comms[0], cpu, seed=3)
    others = [share_weights(get_preset("tiny", layout=layout), comm, standard)
              for layout, comm in zip(["ladder", "upper-bound"], comms[1:])]
    engines = [Engine(model) for model in [standard, *others]]
    prompt, sampling = torch.tensor([[5, 17, 42, 7], [9, 3, 200, 1]]), SamplingParams(temperature=0.8, seed=4)
    alone = [engine.generate(prompt, 4, sampling) for engine in engines]
    in_turns = worker.generate_in_turns(engines, prompt, 4, sampling, shift=1)
    assert [r.tokens for r in in_turns] == [r.tokens for r in alone]
    assert all(len(r.token_latencies_s) == 3 for r in in_turns)
    standard_waits_s = 3 * 2 * 2 * 20e-3  # 3 decode steps x 2 layers x 2 all-reduces x 20 ms
    assert in_turns[0].decode_s >= standard_waits_s
    assert in_turns[2].decode_s < standard_waits_s / 2


def test_layouts_with_the_same_parameters_share_one_copy():
    from ladder.model.config import get_preset
    from ladder.comm.base import LocalCommunicator
    from ladder.model.weights import random_model, share_weights

    comm, cpu = LocalCommunicator(), torch.device("cpu")
    standard = random_model(get_preset("tiny", layout="standard"), comm, cpu, seed=3)
    ladder = share_weights(get_preset("tiny", layout="ladder"), comm, standard)
    assert ladder is not None and ladder.config.layout == "ladder"
    assert [p.data_ptr() for p in ladder.parameters()] == [p.data_ptr() for p in standard.parameters()]
    own = random_model(get_preset("tiny", layout="ladder"), comm, cpu, seed=3)
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(ladder(tokens), own(tokens))
        assert not torch.allclose(ladder(tokens), standard(tokens))  # same weights, another function
    # Parallel has one norm per layer: it shares every weight it has, but standard cannot share its.
    parallel = share_weights(get_preset("tiny", layout="parallel"), comm, standard)
    assert parallel is not None
    shared = {p.data_ptr() for p in standard.parameters()}
    assert {p.data_ptr() for p in parallel.parameters()} <= shared
    copied = random_model(get_preset("tiny", layout="parallel"), comm, cpu, seed=5)
    copied.load_state_dict({name: standard.state_dict()[name].clone() for name in copied.state_dict()})
    with torch.no_grad():
        assert torch.equal(parallel(tokens), copied(tokens))
    assert share_weights(get_preset("tiny", layout="standard"), comm, copied) is None


def test_a_group_of_layouts_computes_with_one_set_of_weights_whatever_their_order():
    from ladder.comm.base import LocalCommunicator

    cpu, layouts = torch.device("cpu"), ["parallel", "standard", "ladder", "upper-bound"]
    point = BenchPoint(preset="tiny", layout="parallel", tp=1, batch_size=1, prompt_len=4, gen_len=2)
    models = worker.build_models([dataclasses.replace(point, layout=layout) for layout in layouts],
                                 [LocalCommunicator()] * len(layouts), cpu)
    assert [m.config.layout for m in models] == layouts
    weights = {p.data_ptr() for p in models[1].parameters()}
    assert all({p.data_ptr() for p in m.parameters()} <= weights for m in models)


def test_every_layout_follows_every_other_in_turns():
    # A rotated order keeps its neighbours: in [s p l u], [p l u s], ... l follows p 3 turns in 4.
    follows = {}
    previous = None
    for turn in range(4000):
        for j in worker.turn_order(4, turn):
            if previous is not None:
                follows[(previous, j)] = follows.get((previous, j), 0) + 1
            previous = j
    pairs = [n for (a, b), n in follows.items() if a != b]  # (a layout also follows itself across turns)
    assert len(pairs) == 12 and max(pairs) / min(pairs) < 1.15, follows
    assert worker.turn_order(4, 7) == worker.turn_order(4, 7)


def test_compiled_decode_waits_at_run_time_and_keeps_the_ladder_overlap(tmp_path):
    """Compiled (one graph per step, no graph break), the emulated link's ops still run at every step,
    not once when the step is traced; and a ladder all-reduce's wait stays after the next module's
    compute. Left alone, inductor moves it up (it fuses the residual add that reads the result into
    the previous norm's kernel) or moves the launch down to it (reorder_for_locality), and the wait
    comes right after the launch, as in standard. The order is read from a profiler trace of the
    ops (timing-free); experiments/investigations/compiled_overlap.py measures what it hides."""
    from ladder.model.config import get_preset
    from ladder.runtime.engine import Engine
    from ladder.runtime.sampling import SamplingParams
    from ladder.bench.trace import profile_generation
    from ladder.model.weights import random_model

    from helpers import in_flight_at_each_wait

    cpu = torch.device("cpu")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    for layout, expected in (("standard", [1] * 8), ("ladder", [2] * 7 + [1])):  # per step of 8 modules
        comm = EmulatedCommunicator(LinkModel("test", latency_us=500.0, bandwidth_gbps=1.0), world_size=2, device=cpu)
        engine = Engine(random_model(get_preset("tiny", layout=layout), comm, cpu), DecodeStep.COMPILED)
        engine.generate(prompt, 6)  # traces and compiles the decode step
        comm.reset_counters()
        start = time.perf_counter()
        engine.generate(prompt, 6)
        elapsed = time.perf_counter() - start
        assert comm.count == 2 * 4 * 6  # 2 per layer x 4 layers, prefill + 5 decode steps, all at run time
        if layout == "standard":
            assert elapsed >= comm.modelled_s  # it waits for every transfer, one after another
        events = profile_generation(engine, prompt, 6, SamplingParams(), comm, tmp_path / f"{layout}.json", max_seq=11)
        at_each_wait = in_flight_at_each_wait(events, "ladder::emulated_all_reduce", ("ladder::emulated_wait",))
        assert at_each_wait == expected * 5, (layout, at_each_wait)  # decode steps (the prefill runs eagerly)


def test_sweep_under_torchrun_keeps_one_group_for_every_configuration(tmp_path):
    # Made anew for each configuration, the process group's set-up hung about one time in two.
    out = tmp_path / "r.jsonl"
    result = torchrun_ladder("bench", "--preset", "tiny", "--tp", "2", "--batch-sizes", "1,2", "--layouts",
                             "standard,ladder,upper-bound", "--runs", "1", "--prompt-len", "4", "--gen-len", "2",
                             "--no-progress", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_results(out)  # written by global rank 0 only: one line per configuration
    assert [(r["layout"], r["batch_size"], r["status"]) for r in records] == [
        (layout, b, "ok") for b in (1, 2) for layout in ("standard", "ladder", "upper-bound")]


TWO_NODE_SWEEP = ["bench", "--preset", "tiny", "--tp", "2", "--batch-sizes", "1,2", "--layouts", "standard,ladder",
                  "--runs", "1", "--prompt-len", "4", "--gen-len", "2", "--no-progress", "--out", "r.jsonl"]


def test_two_nodes_resume_from_rank_0s_results_file(tmp_path, capsys):
    """Only node 0 has the file (`--out` is a path on each machine): node 1 must skip what node 0 skips,
    or the ranks pair the collectives of different configurations."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    whole = ladder_in_process(capsys, *TWO_NODE_SWEEP[:-1], str(node0 / "r.jsonl"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = read_results(node0 / "r.jsonl")[0]
    (node0 / "r.jsonl").write_text(json.dumps(first) + "\n")  # as if stopped after the first configuration
    (status0, out0, err0), (status1, out1, err1) = torchrun_on_two_nodes([[*TWO_NODE_SWEEP, "--resume"]] * 2,
                                                                         [node0, node1])
    assert (status0, status1) == (0, 0), err0[-3000:] + err1[-3000:]
    assert "3 configurations measured, 0 failed, 1 from earlier runs" in out0 and out1 == ""
    records = read_results(node0 / "r.jsonl")
    assert [(r["layout"], r["batch_size"]) for r in records] == [("standard", 1), ("ladder", 1), ("standard", 2),
                                                                 ("ladder", 2)]
    assert not (node1 / "r.jsonl").exists()  # rank 0 writes the results


def test_two_nodes_started_with_different_commands_stop_with_one_line_each(tmp_path):
    other = [*TWO_NODE_SWEEP]
    other[other.index("--gen-len") + 1] = "3"
    nodes = torchrun_on_two_nodes([TWO_NODE_SWEEP, other], [tmp_path, tmp_path])
    for rank, (status, _, err) in enumerate(nodes):
        assert status != 0
        said = ladder_lines(err)
        assert said == [f"ladder: error: rank {1 - rank} and rank {rank} are about to measure different "
                        "configurations (they differ in gen_len): start every node with the same command"], err
    assert not (tmp_path / "r.jsonl").exists()


def test_under_torchrun_a_real_link_runs_at_the_world_size_only(tmp_path):
    # Before, --tp 1 under a 2-rank torchrun ran sharded over both ranks and was recorded as TP 1.
    result = torchrun_ladder("bench", "--preset", "tiny", "--tp", "1,2", "--batch-sizes", "1", "--layouts", "standard",
                             "--runs", "1", "--prompt-len", "4", "--gen-len", "2", "--no-progress",
                             "--out", str(tmp_path / "r.jsonl"))
    assert result.returncode != 0
    said = set(ladder_lines(result.stderr))
    assert said == {"ladder: error: under torchrun (WORLD_SIZE=2) the real interconnect runs at --tp 2 only, not 1; "
                    "an emulated link (--interconnect NAME) runs any --tp on each rank"}, result.stderr[-3000:]
    assert not (tmp_path / "r.jsonl").exists()


GPU_RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu"


@pytest.mark.parametrize(("path", "parallel_has_own_weights"), [
    ("llama-3-70b-tp8-shard.jsonl", True), ("h200/llama-3-70b-tp8-shard-compiled.jsonl", False),
    ("h200/compiled-tp1.jsonl", False), ("h200/quantized-tp1.jsonl", False),
    ("h200/hybrid/llama-3-70b-tp8-shard-hybrid.jsonl", False), ("h100/llama-3-70b-tp8-shard-compiled.jsonl", False),
    ("h100/compiled-tp1.jsonl", False)])
def test_memory_estimate_is_close_to_the_peak_a_gpu_measured(path, parallel_has_own_weights):
    """results/gpu holds peak allocated memory per configuration, measured on H100s and an H200
    (scripts/gpu_checks.sh): the 70B TP-8 shard (eager and compiled), Llama-3-8B at batch 1 and 16, and 8B in int4; the
    estimate that refuses configurations must stay near it. (An older estimate counted the prefill's
    logits at every position and refused batch 64 of four layouts.) The H100 groups were measured when
    parallel held a copy of the weights of its own: two sets; on the H200 every layout shares one."""
    measured = [r for r in read_results(GPU_RESULTS / path) if r["status"] == "ok" and r["layout"] == "standard"]
    assert measured
    for r in measured:
        layouts = (r.get("interleaved") or {}).get("layouts", [r["layout"]])
        weight_sets = len({layout == "parallel" for layout in layouts}) if parallel_has_own_weights else 1
        config = get_preset(r["preset"])
        estimate = estimate_memory_bytes(config, r["tp"], r["batch_size"], r["prompt_len"],
                                               r["prompt_len"] + r["gen_len"], 2, len(layouts),
                                               weight_sets=weight_sets, quantize=r.get("quantize"))
        assert estimate == pytest.approx(r["peak_memory_bytes"], rel=0.05), (r["batch_size"], layouts)


def test_a_setting_added_after_a_record_was_written_takes_its_default():
    point = BenchPoint("tiny", "ladder", tp=1, batch_size=1, prompt_len=4, gen_len=2)
    older = point.describe()
    del older["cuda_graph"]  # written before --cuda-graph existed
    assert records.point_key(older, 0) == records.point_key(point.describe(), 0)
    assert records.point_key(older, 0) != records.point_key(dataclasses.replace(point, decode_step=DecodeStep.CUDA_GRAPH).describe(), 0)


def test_the_summary_says_when_there_is_too_little_communication_to_judge_the_hidden_fraction():
    def record(batch, layout, tokens_per_s):
        return {"status": "ok", "preset": "tiny", "interconnect": "nvlink-h100", "emulated": True, "tp": 2,
                "batch_size": batch, "prompt_len": 8, "gen_len": 4, "layout": layout, "tokens_per_s": tokens_per_s,
                "env": {"device_name": "cpu"}}

    # batch 1: the upper bound is 3 % faster than standard (communication is 2.9 % of its time); batch 4: 33 %
    records = [record(1, "standard", 100.0), record(1, "ladder", 101.0), record(1, "upper-bound", 103.0),
               record(4, "standard", 100.0), record(4, "ladder", 130.0), record(4, "upper-bound", 133.0)]
    rows = summarise(records)
    assert all(r["hidden"] is not None for r in rows if r["layout"] == "ladder")
    notes = [line for line in format_summary(rows).splitlines() if line.startswith("note:")]
    assert notes == ["note: tiny nvlink-h100 (emulated) tp=2 batch 1: communication is 2.9% of standard's time, "
                     "so the hidden fraction there is mostly noise; dilate the emulated link to measure it "
                     "(--comm-share 0.25)"]
    assert notes[0] in format_summary(rows, markdown=True)
    # batch 2: upper bound no faster than standard (noise, on a real link): a blank cell, and why
    slower = [r | {"batch_size": 2, "interconnect": "real", "emulated": False} for r in records[:2]] + \
        [records[2] | {"batch_size": 2, "interconnect": "real", "emulated": False, "tokens_per_s": 99.0}]
    rows = summarise(slower)
    assert [r["hidden"] for r in rows if r["layout"] == "ladder"] == [None]
    assert [line for line in format_summary(rows).splitlines() if line.startswith("note:")] == [
        "note: tiny real tp=2 batch 2: upper bound measured no faster than standard, so no communication was "
        "seen to hide; measure more runs, in turns (--interleave steps --rounds 3)"]
    dilated = [r | {"interconnect": "pcie-no-p2p", "emulated": True, "comm_share": 0.25} for r in slower]
    note = [line for line in format_summary(summarise(dilated)).splitlines() if line.startswith("note:")]
    assert note[0].endswith("hide; measure more runs, in turns (--interleave steps --rounds 3)")  # dilated already
