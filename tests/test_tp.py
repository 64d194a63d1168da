"""Every layout at TP=2 (two real gloo processes) equals the same layout at TP=1."""

import os

import pytest
import torch

from helpers import INT8_RELATIVE_ERROR, cached_logits, make_model, overlapped_modules, relative_error, tiny, tp_worker
from ladder.comm.launch import launch
from ladder.train.simulate import SimulatedRanks

# TP=2 splits each module's matmuls in two and sums the partials with gloo, so results differ from
# TP=1 only by fp32 summation order: measured at most 2.4e-7 on logits of magnitude <1.4. 2e-5 absolute
# leaves two orders of magnitude of margin and still catches any wrong slice or missing reduction
# (those produce errors of order 1e-2 or more).
ATOL = 2e-5

PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
DECODE = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(4))

QUANTIZABLE = dict(ffn_hidden=128)  # int4 groups of 32 columns divide each rank's 64 and 32 (tiny's 160 does not)
CASES = {
    "standard": (tiny(), False),
    "parallel": (tiny(layout="parallel"), False),
    "ladder": (tiny(layout="ladder"), False),
    "ladder_layers=0": (tiny(layout="ladder", ladder_layers=0), False),
    "ladder_layers=1": (tiny(layout="ladder", ladder_layers=1), False),
    "ladder_layers=L-1": (tiny(layout="ladder", ladder_layers=3), False),
    "ladder_layers=L": (tiny(layout="ladder", ladder_layers=4), False),
    "ladder, vocab sharded": (tiny(layout="ladder"), True),
    "tied embeddings, vocab sharded": (tiny(layout="ladder", tie_embeddings=True), True),
    "MQA (1 KV head replicated)": (tiny(n_kv_heads=1, layout="ladder", ladder_layers=2), False),
    "3 KV groups over 2 ranks (uneven)": (tiny(dim=96, n_heads=6, n_kv_heads=3, layout="ladder"), False),
    "desync, every module reduced": (tiny(layout="desync", desync_reduce="all"), False),
    "desync, default pattern": (tiny(layout="desync"), False),
    "upper-bound": (tiny(layout="upper-bound"), False),
    "desync, uneven KV groups": (tiny(dim=96, n_heads=6, n_kv_heads=3, layout="desync"), False),
}
# Each rank quantizes its own shard (ladder.quant.quantize). int4's groups of 32 input columns fall inside a
# shard, so a rank's groups are the whole model's and TP=2 computes what TP=1 int4 does (ATOL);
# int8's per-row scales of the row-parallel layers are per rank's half row, so TP=2 int8 is another
# (finer) quantization, held to the unquantized model by test_quantize's tolerance instead.
QUANTIZED = {
    "standard int4": (tiny(**QUANTIZABLE), False, "int4"),
    "ladder int4": (tiny(layout="ladder", **QUANTIZABLE), False, "int4"),
    "hybrid int4": (tiny(layout="ladder", ladder_layers=2, **QUANTIZABLE), False, "int4"),
    "parallel int4": (tiny(layout="parallel", **QUANTIZABLE), False, "int4"),
    "ladder int8": (tiny(layout="ladder", **QUANTIZABLE), False, "int8"),
    "desync int8": (tiny(layout="desync", **QUANTIZABLE), False, "int8"),
}
ALL_CASES = [(*case, None) for case in CASES.values()] + list(QUANTIZED.values())
PER_TP = ("desync, default pattern", "upper-bound", "desync, uneven KV groups")  # defined per TP degree
# At TP=2 these compare against a *different* TP=1 model (by design of layouts.md):
EXPECTED_AT_TP1 = {"desync, every module reduced": tiny()}


@pytest.fixture(scope="module")
def tp2():
    results = launch(tp_worker, 2, ALL_CASES, PROMPT, DECODE)
    assert sorted(results) == [0, 1]
    return results


def _tp1(name):
    config, _ = CASES[name]
    return cached_logits(make_model(EXPECTED_AT_TP1.get(name, config)), PROMPT, DECODE)


@pytest.mark.parametrize("name", [n for n in CASES if n not in PER_TP])
def test_tp2_equals_tp1(tp2, name):
    index = list(CASES).index(name)
    expected = _tp1(name)
    for rank in (0, 1):
        got = tp2[rank]["logits"][index]
        assert len(got) == 1 + DECODE.shape[1]  # prefill and every decode step
        for step_got, step_expected in zip(got, expected):
            torch.testing.assert_close(step_got, step_expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", [name for name in QUANTIZED if "int4" in name])
def test_int4_at_tp2_equals_int4_at_tp1(tp2, name):
    config, _, mode = QUANTIZED[name]
    expected = cached_logits(make_model(config, quantize=mode), PROMPT, DECODE)
    for rank in (0, 1):
        for step_got, step_expected in zip(tp2[rank]["logits"][len(CASES) + list(QUANTIZED).index(name)], expected):
            torch.testing.assert_close(step_got, step_expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", [name for name in QUANTIZED if "int8" in name])
def test_int8_at_tp2_is_within_int8s_error_of_the_unquantized_model(tp2, name):
    config, _, _ = QUANTIZED[name]
    if config.layout == "desync":  # defined per TP degree: its TP=2 reference is the simulated ranks
        with torch.no_grad():
            expected = [SimulatedRanks(make_model(config), tp=2)(PROMPT)]
    else:
        expected = cached_logits(make_model(config), PROMPT, DECODE)
    got = tp2[0]["logits"][len(CASES) + list(QUANTIZED).index(name)]
    for step_got, step_expected in zip(got, expected):
        assert relative_error(step_got, step_expected) < INT8_RELATIVE_ERROR


@pytest.mark.parametrize("name", ["desync, default pattern", "upper-bound"])
def test_unsynchronised_layouts_depend_on_tp(tp2, name):
    # Desync (dropped attention reductions) and upper bound (no reductions) are defined per TP degree:
    # at TP=2 they must compute something else than at TP=1, or no communication was dropped.
    index = list(CASES).index(name)
    got, expected = tp2[0]["logits"][index][0], _tp1(name)[0]
    assert (got - expected).abs().max() > 1e-3


def test_desync_final_stream_is_synchronised(tp2):
    index = list(CASES).index("desync, default pattern")
    for a, b in zip(tp2[0]["logits"][index], tp2[1]["logits"][index]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["desync, default pattern", "desync, uneven KV groups"])
def test_simulated_ranks_equal_real_ranks(tp2, name):
    # What desync training optimises (two ranks simulated in one process from the whole weights) is what
    # two real gloo ranks compute from their loaded shards.
    index = list(CASES).index(name)
    with torch.no_grad():
        simulated = SimulatedRanks(make_model(CASES[name][0]), tp=2)(PROMPT)
    torch.testing.assert_close(tp2[0]["logits"][index][0], simulated, atol=ATOL, rtol=0)


def test_simulated_ranks_with_every_module_reduced_are_standard():
    with torch.no_grad():
        simulated = SimulatedRanks(make_model(tiny(layout="desync", desync_reduce="all")), tp=2)(PROMPT)
        torch.testing.assert_close(simulated, make_model(tiny())(PROMPT), atol=ATOL, rtol=0)


def test_real_gloo_schedule_overlaps_ladder_only(tp2):
    for rank in (0, 1):
        schedules = tp2[rank]["schedules"]
        assert all(overlapped_modules(schedules["ladder"]))
        assert not any(overlapped_modules(schedules["standard"]))
        hybrid = overlapped_modules(schedules["hybrid"])  # ladder on the last 2 of 4 layers
        assert hybrid == [j >= 3 for j in range(len(hybrid))]  # and the last standard MLP (module 3)
        assert all(overlapped_modules(schedules["ladder int4"]))  # quantized weights keep the schedule


def _gloo_threads_after_shutdown() -> tuple[int, int, int]:
    """Threads of this rank: before the group, with it (after collectives of every kind), after shutdown."""
    from ladder.comm.distributed import init_distributed, shutdown_distributed

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    comm = init_distributed("cpu").communicator()
    x = torch.ones(2, 3)
    comm.all_reduce(x), comm.all_reduce_async(x).wait(), comm.all_gather_last_dim(x)
    during = threads()
    shutdown_distributed()  # the communicator is still alive here, as a model holding it would be
    return before, during, threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_shutdown_joins_the_gloo_threads_while_python_is_alive():
    """Left to interpreter finalization, a gloo thread releasing its last collective takes the GIL and
    aborts the process (SIGABRT) now and then; shutdown must end them (see ladder.comm.distributed)."""
    for before, during, after in launch(_gloo_threads_after_shutdown, 2).values():
        assert during > before and after == before, (before, during, after)
