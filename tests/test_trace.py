"""Profiler traces: the overlap read back from a trace, on hand-made traces and on real bench runs."""

import sys
from pathlib import Path

import pytest

from ladder.bench import paper_comparison
from ladder.bench.spec import BenchPoint
from ladder.bench.summary import read_results
from ladder.bench.sweep import run_sweep
from ladder.bench.trace import SYNC_MARKER, link_overlap, read_trace
from ladder.comm.links import LinkModel
from ladder.options import DecodeStep

from helpers import in_flight_at_each_wait


def op(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_overlap_of_a_hand_made_cpu_trace():
    events = [
        op(SYNC_MARKER, 0, 1),
        op("emulated all-reduce", 100, 100, cat="link", tid="link"),  # 100..200
        op("aten::mm", 120, 50),  # 50 of the link's 100 us covered by compute
        op("aten::add", 150, 10),  # nested in time with the mm: counted once
        op("emulated all-reduce", 300, 50, cat="link", tid="link"),  # 300..350: nothing runs
        op("aten::mm", 400, 50, tid=2),  # another thread: not the one that issued the collectives
    ]
    result = link_overlap(events)
    assert result["link_events"] == 2
    assert result["link_s"] == pytest.approx(150e-6)
    assert result["overlapped_s"] == pytest.approx(50e-6)
    assert result["overlap_fraction"] == pytest.approx(1 / 3)


def test_time_inside_collective_ops_is_not_compute():
    events = [
        op(SYNC_MARKER, 0, 1),
        op("gloo:all_reduce", 100, 100, cat="user_annotation", tid=9),  # gloo's worker thread
        op("c10d::allreduce_", 90, 40),  # the launch, with its own copy inside: not compute
        op("aten::copy_", 95, 20),
        op("_c10d_functional::wait_tensor", 180, 30),
        op("aten::mm", 130, 30),  # between launch and wait: compute that overlaps
    ]
    assert link_overlap(events)["overlapped_s"] == pytest.approx(30e-6)


def test_gpu_trace_uses_kernels():
    events = [
        op("spin_kernel(long)", 0, 100, cat="kernel", tid=7),  # the emulated link's sleep, side stream
        op("sm90_gemm_bf16", 50, 100, cat="kernel", tid=8),
        op("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 300, 100, cat="kernel", tid=9),
        op("aten::mm", 300, 100),  # host-side: does not count once there are kernels
    ]
    result = link_overlap(events)
    assert result["link_events"] == 2 and result["overlap_fraction"] == pytest.approx(50 / 200)


def test_no_communication_gives_none():
    assert link_overlap([op(SYNC_MARKER, 0, 1), op("aten::mm", 10, 10)]) is None


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    link = LinkModel("slow", 300.0, 1.0)
    common = dict(tp=2, batch_size=1, prompt_len=8, gen_len=4, runs=1, profile_dir=str(folder), profile_tokens=6)
    points = [BenchPoint("tiny", layout, link=lk, **common)
              for lk in (link, None) for layout in ("standard", "ladder")]
    run_sweep(points, folder / "r.jsonl", progress=False)
    return {(r["interconnect"], r["layout"]): r for r in read_results(folder / "r.jsonl")}


def test_bench_traces_show_overlap_for_ladder_only(traced):
    calls = 4 * 2 * 6  # layers x modules x forward passes (a prefill and 5 decode steps for 6 tokens)
    for (interconnect, layout), r in traced.items():
        assert r["status"] == "ok", r
        trace = r["trace"]
        assert trace["path"].endswith("rank0.json") and trace["new_tokens"] == 6
        assert trace["link"]["link_events"] == calls, (interconnect, layout)
        assert link_overlap(read_trace(trace["path"])) == trace["link"]
        if layout == "standard":  # every all-reduce is waited on at once: nothing computes meanwhile
            assert trace["link"]["overlap_fraction"] < 0.02, (interconnect, trace)
    # emulated: the next module computes while the modelled transfer is in flight
    assert traced[("slow", "ladder")]["trace"]["link"]["overlap_fraction"] > 0.1
    assert traced[("real", "ladder")]["trace"]["link"]["overlapped_s"] > 0


def test_paper_comparison_report(traced, monkeypatch, capsys):
    results = Path(traced[("slow", "ladder")]["trace"]["path"]).parent / "r.jsonl"
    monkeypatch.setattr(sys, "argv", ["paper_comparison.py", str(results)])
    paper_comparison.main()
    out = capsys.readouterr().out
    assert "| slow (emulated) | 2 | 1 | ladder |" in out
    assert "tiny-ladder-tp2-bs1-slow-rank0.json" in out


def test_paper_comparison_leaves_out_the_traces_of_an_unprofiled_sweep(traced):
    """The compiled 70B sweep of scripts/gpu_checks.sh is not profiled: no empty table for it."""
    traces = paper_comparison.traces
    assert traces([{**r, "trace": None} for r in traced.values()]) == ""
    assert "tiny-ladder-tp2-bs1-slow-rank0.json" in traces(list(traced.values()))


def test_paper_speedups_match_the_published_table():
    paper = paper_comparison.paper_speedups()
    assert paper[("ladder", "on", 8, 1)] == pytest.approx(1.308, abs=1e-3)  # docs/paper-results.md
    assert paper[("ladder", "off", 8, 1)] == pytest.approx(1.599, abs=1e-3)
    assert paper[("upper-bound", "off", 8, 1)] == pytest.approx(110.59 / 51.66)


def test_compiled_ladder_launches_the_next_all_reduce_before_each_wait(tmp_path):
    """Real gloo TP 2, decode compiled into one graph: when a ladder all-reduce is waited on, the next
    module's all-reduce is already launched, so that module computed while the first was in flight.
    (Traced, funcol.all_reduce waits at once, and inductor moves waits up and launches down unless
    told otherwise: the raw op, `wait(after=...)` and reorder_for_locality=False keep the schedule.)"""
    point = BenchPoint("tiny", "ladder", tp=2, batch_size=1, prompt_len=8, gen_len=6, runs=1, decode_step=DecodeStep.COMPILED,
                       profile_dir=str(tmp_path), profile_tokens=6)
    run_sweep([point], tmp_path / "r.jsonl", progress=False)
    (record,) = read_results(tmp_path / "r.jsonl")
    assert record["status"] == "ok", record
    at_each_wait = in_flight_at_each_wait(read_trace(record["trace"]["path"]), "_c10d_functional::all_reduce_",
                                          ("ladder::wait_after", "_c10d_functional::wait_tensor"))
    # per decode step, 8 modules: modules 0-6's waits come after the next launch; the last is exposed
    assert at_each_wait == ([2] * 7 + [1]) * 5


@pytest.mark.parametrize("card", ["h200", "h100"])
def test_compiled_step_traces_show_ladder_overlapping_the_emulated_link_and_standard_not(card):
    """Traces of the 70B TP-8 shard's compiled step (--compile-layers --cuda-graph) on an H200 and an H100
    (the residual adds compiled into the steps there), emulated nvlink-h100, batch 1 (results/gpu/CARD/traces):
    the overlap survives compilation and graph capture."""
    results = Path(__file__).resolve().parents[1] / "results" / "gpu" / card
    records = {r["layout"]: r for r in read_results(results / "llama-3-70b-tp8-shard-compiled.jsonl")
               if r["status"] == "ok" and r["batch_size"] == 1 and r["interconnect"] == "nvlink-h100"}
    overlap = {}
    for layout in ("standard", "ladder"):
        name = Path(records[layout]["trace"]["path"]).name
        overlap[layout] = link_overlap(read_trace(results / "traces" / f"{name}.gz"))
        assert overlap[layout] == pytest.approx(records[layout]["trace"]["link"])
        assert overlap[layout]["link_events"] == 4 * 160
    assert overlap["standard"]["overlap_fraction"] < 0.01
    assert overlap["ladder"]["overlap_fraction"] > 0.5  # H200: 0.39 in the eager prefill, 0.90 in the decode steps


@pytest.mark.parametrize("batch", [1, 64])
def test_h100_traces_show_ladder_overlapping_the_emulated_link_and_standard_not(batch):
    """Traces from scripts/gpu_checks.sh on an H100 (70B TP-8 shard, emulated pcie-no-p2p; kept gzipped
    in results/gpu/traces): read back, they give the overlap their records report."""
    results = Path(__file__).resolve().parents[1] / "results" / "gpu"
    records = {r["layout"]: r for r in read_results(results / "llama-3-70b-tp8-shard.jsonl")
               if r["status"] == "ok" and r["batch_size"] == batch and r["interconnect"] == "pcie-no-p2p"}
    overlap = {}
    for layout in ("standard", "ladder"):
        name = Path(records[layout]["trace"]["path"]).name
        overlap[layout] = link_overlap(read_trace(results / "traces" / f"{name}.gz"))
        assert overlap[layout] == pytest.approx(records[layout]["trace"]["link"])
        assert overlap[layout]["link_events"] == 4 * 160  # 160 all-reduces in the prefill and each of 3 decode steps
    assert overlap["standard"]["overlap_fraction"] < 0.01
    assert overlap["ladder"]["overlap_fraction"] > 0.6
