"""`ladder bench link`: this machine's all-reduce timed by size on a real gloo group, and the link fitted to it."""

import json

import pytest

from ladder.bench.linkbench import AllReduceTiming, fit_measured_link, format_size, parse_size
from ladder.comm.links import LinkModel, fit_link
from ladder.errors import LadderError

from helpers import ladder_cli, ladder_in_process


@pytest.mark.parametrize("text,n_bytes", [("4096", 4096), ("4K", 4096), ("64k", 65536), ("16M", 16 * 2**20),
                                          ("1GiB", 2**30), ("256KB", 256 * 1024)])
def test_sizes_read_in_binary_units(text, n_bytes):
    assert parse_size(text) == n_bytes
    assert parse_size(format_size(n_bytes).replace(" ", "")) == n_bytes


@pytest.mark.parametrize("text", ["", "0", "4X", "-4K", "1.5M"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(LadderError, match="--sizes takes sizes such as"):
        parse_size(text)


def timings_of(link: LinkModel, tps: list[int], sizes: list[int]) -> list[AllReduceTiming]:
    return [AllReduceTiming(tp, n, link.all_reduce_s(n, tp)) for tp in tps for n in sizes]


SIZES = [4096, 65536, 2**20, 16 * 2**20]


def test_the_fit_recovers_the_link_the_timings_came_from():
    link = LinkModel("truth", 25.0, 80.0, 3.0)
    at_one_tp = fit_measured_link(timings_of(link, [4], SIZES), "here")  # latency and per-rank latency are one
    assert at_one_tp.latency_us == pytest.approx(link.latency_s(4) * 1e6, rel=1e-4)
    assert at_one_tp.latency_per_rank_us == 0 and at_one_tp.bandwidth_gbps == pytest.approx(80.0, rel=1e-4)
    at_two = fit_measured_link(timings_of(link, [2, 8], SIZES), "here")
    assert (at_two.latency_us, at_two.latency_per_rank_us, at_two.bandwidth_gbps) == pytest.approx((25, 3, 80), rel=1e-4)


def test_sizes_too_large_to_show_a_latency_give_a_link_without_one():
    """Noise on large messages can pull the fitted latency below zero, which no link has: the
    bandwidth is then fitted alone."""
    truth = LinkModel("truth", 0.0, 50.0)
    sizes, noise = [2**22, 2**24, 2**26], [0.97, 1.0, 1.01]  # the smallest ran fast: the line meets zero late
    timings = [AllReduceTiming(2, n, truth.all_reduce_s(n, 2) * k) for n, k in zip(sizes, noise)]
    assert unconstrained_fit(timings).latency_us < 0
    link = fit_measured_link(timings, "here")
    assert link.latency_us == 0 and link.bandwidth_gbps == pytest.approx(50.0, rel=0.03)


def unconstrained_fit(timings: list[AllReduceTiming]) -> LinkModel:
    return fit_link("x", [(t.tp, [(1, t.n_bytes)], t.seconds * 1e6) for t in timings], "")


def test_timings_that_do_not_grow_with_the_size_fit_no_bandwidth():
    flat = [AllReduceTiming(2, n, 1e-3 * (1.1 if n == 4096 else 1.0)) for n in SIZES]
    with pytest.raises(LadderError, match="no bandwidth can be fitted"):
        fit_measured_link(flat, "here")


@pytest.mark.slow
def test_bench_link_times_a_real_gloo_group_and_fits_it():
    out = ladder_cli("bench", "link", "--tp", "2", "--sizes", "4K,4M", "--warmup", "2", "--iters", "5", "--json")
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout)
    timings = measured["timings"]
    assert [(t["tp"], t["n_bytes"]) for t in timings] == [(2, 4096), (2, 4 * 2**20)]
    for t in timings:  # nccl-tests' definitions; a ring all-reduce over 2 ranks carries the message once
        assert t["algbw_gbps"] == pytest.approx(t["n_bytes"] / t["seconds"] / 1e9)
        assert t["busbw_gbps"] == pytest.approx(t["algbw_gbps"])
    assert timings[1]["seconds"] > timings[0]["seconds"] > 0
    link = LinkModel(**measured["link"])
    assert link.latency_us >= 0 and link.bandwidth_gbps > 0 and link.source.startswith("ladder bench link on ")


@pytest.mark.parametrize("args,message", [
    (["--tp", "1"], "--tp must be at least 2 to have an all-reduce to time, got 1"),
    (["--sizes", "6"], "--sizes: 6 bytes is not a whole number of float32 elements (4 bytes)"),
    (["--sizes", "4K,4Q"], "--sizes takes sizes such as 4096, 64K or 16M, got '4Q'"),
    (["--iters", "0"], "--iters must be >= 1 and --warmup >= 0, got 0 and 5"),
])
def test_bench_link_bad_input_is_one_line(args, message, capsys):
    out = ladder_in_process(capsys, "bench", "link", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert message in lines[0]
