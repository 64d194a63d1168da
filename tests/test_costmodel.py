"""The cost model: stored constants come from the fit, held-out error on the paper's table."""

import json
import math
import random
from dataclasses import asdict
from importlib import resources

import pytest

from ladder.comm.links import link_presets
from ladder.predict.costmodel import (GPUS, CostConstants, Workload, fitted_constants, get_gpu, predict_table,
                                      predict_tokens_per_s)
from ladder.predict.fit import (BOUNDS, HELD_OUT_BATCHES, TRAIN_BATCHES, fit_constants, fit_error, fit_on_paper,
                                validate, validate_unseen)
from ladder.comm.links import get_link
from ladder.model.config import get_preset
from ladder.predict.paper import UNSEEN_SETTINGS, fit_paper_links, paper_table

from helpers import ladder_in_process


def test_stored_constants_are_the_fit_of_the_training_split():
    stored = asdict(fitted_constants())
    fresh = asdict(fit_on_paper())
    assert stored.keys() == fresh.keys()
    for name in stored:  # (abs: a constant fitted onto its bound of 0 ends within 1e-11 of it)
        assert fresh[name] == pytest.approx(stored[name], rel=1e-6, abs=1e-9), name


def test_stored_paper_links_are_the_fit_of_the_paper_measurements():
    fitted = fit_paper_links()
    assert fitted.keys() == {"nvlink-h100", "pcie-no-p2p"}
    for name, link in fitted.items():
        assert link_presets()[name] == link, name


def test_the_fit_is_the_lowest_minimum_other_starts_find():
    """The stored constants are the least-squares minimum, not where an optimiser stopped: fits from
    random starting constants end no lower (some end in worse local minima)."""
    rows = [r for r in paper_table() if r["batch_size"] in TRAIN_BATCHES]
    lowest = fit_error(rows, fitted_constants())
    rng = random.Random(0)
    for _ in range(4):
        start = {}
        for name, value in asdict(CostConstants()).items():
            lo, hi = BOUNDS.get(name, (0.0, math.inf))
            start[name] = min(max(value * rng.uniform(0.3, 2.0), lo + 1e-3), hi - 1e-3)
        assert fit_error(rows, fit_constants(rows, start)) >= lowest * (1 - 1e-6)


def test_held_out_speedup_error():
    report = validate()
    assert set(TRAIN_BATCHES).isdisjoint(HELD_OUT_BATCHES)
    assert {p["batch_size"] for p in report["points"]} == set(HELD_OUT_BATCHES)
    assert len(report["points"]) == 10
    # The issue asks for 80 %; this model reaches it, 8/10, the eighth point by 0.005 (TP 4, batch 4,
    # P2P off). The two misses are batch 4 with P2P off too (docs/costmodel.md).
    assert report["fraction_within"] >= 0.8
    stored = json.loads(resources.files("ladder").joinpath("data/costmodel-fit.json").read_text())
    assert stored["validation"]["fraction_within"] == report["fraction_within"]


def test_unseen_settings_read_the_paper_8b_and_405b_speedups():
    stored = json.loads(resources.files("ladder").joinpath("data/costmodel-fit.json").read_text())["unseen"]
    shape = validate_unseen(UNSEEN_SETTINGS["llama-3-8b"])
    assert {(p["layout"], p["tp"], p["batch_size"], p["p2p"]) for p in shape["points"]} == {
        (layout, 8, b, "on") for layout in ("ladder", "parallel") for b in (1, 4, 8, 16, 32, 64)}
    assert all(1.2 < p["published"] < 1.45 and p["predicted"] > 1.0 for p in shape["points"])
    two_nodes = validate_unseen(UNSEEN_SETTINGS["llama-3.1-405b"])
    assert {(p["tp"], p["batch_size"], p["p2p"], p["interconnect"]) for p in two_nodes["points"]} == {
        (16, b, p2p, link) for b in (1, 4, 8, 16) for p2p, link in (("on", "infiniband-ndr"), ("off", "pcie-no-p2p"))}
    assert all(1.3 <= p["published"] < 1.6 and p["predicted"] > 1.0 for p in two_nodes["points"])
    for report in (shape, two_nodes):
        assert stored[report["setting"]]["fraction_within"] == report["fraction_within"]


def test_link_presets_reproduce_the_paper_all_reduce_costs():
    rows = {(r["layout"], r["tp"], r["batch_size"], r["p2p"]): r["tokens_per_s"] for r in paper_table()}
    for p2p, name in (("on", "nvlink-h100"), ("off", "pcie-no-p2p")):
        link = get_link(name)
        # the per-all-reduce cost of a 16 KiB message implied by the 70B batch-1 TP-8 rows
        gap = (1 / rows[("standard", 8, 1, p2p)] - 1 / rows[("upper-bound", 8, 1, "on")]) / 160
        assert link.all_reduce_s(16 * 1024, 8) == pytest.approx(gap, rel=0.1)


def test_layout_order_and_scaling():
    w = Workload(get_preset("llama-3-70b"), tp=8, batch_size=1)
    link, gpu, k = get_link("nvlink-h100"), GPUS["h100"], fitted_constants()
    t = {layout: predict_tokens_per_s(w, layout, gpu, link, k) for layout in ("standard", "parallel", "ladder", "upper-bound")}
    assert t["standard"] < t["parallel"] < t["upper-bound"]
    assert t["standard"] < t["ladder"] < t["upper-bound"]
    slow = get_link("pcie-no-p2p")
    speedup = lambda lk: predict_tokens_per_s(w, "ladder", gpu, lk, k) / predict_tokens_per_s(w, "standard", gpu, lk, k)
    assert speedup(slow) > speedup(link)  # ladder buys more on a slower interconnect
    h200 = predict_tokens_per_s(w, "standard", GPUS["h200"], link, k)
    assert h200 > t["standard"]  # more HBM bandwidth, faster decode


def test_predict_command_prints_the_table_of_the_api(capsys):
    out = ladder_in_process(capsys, "predict", "--preset", "llama-3-70b", "--gpu", "h100", "--interconnect",
                            "nvlink-h100,pcie-no-p2p", "--tp", "4,8", "--batch-sizes", "1,16", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    layouts = ("standard", "parallel", "ladder", "upper-bound")
    links, tps = ("nvlink-h100", "pcie-no-p2p"), (4, 8)
    assert [(r["interconnect"], r["tp"], r["batch_size"], r["layout"]) for r in rows] == [
        (link, tp, b, layout) for link in links for tp in tps for b in (1, 16) for layout in layouts]
    expected = [row for link in links for tp in tps
                for row in predict_table("llama-3-70b", GPUS["h100"], get_link(link), tp, [1, 16], list(layouts),
                                         1024, 512)]
    assert [r["tokens_per_s"] for r in rows] == pytest.approx([r["tokens_per_s"] for r in expected], rel=1e-9)


def test_predicted_hidden_fraction_is_the_papers_definition_on_ladder_rows_only():
    rows = predict_table("llama-3-70b", GPUS["h100"], get_link("pcie-no-p2p"), 8, [1, 64],
                         ["standard", "parallel", "ladder", "upper-bound"], 1024, 512)
    by = {(r["batch_size"], r["layout"]): r for r in rows}
    for b in (1, 64):
        seconds = {layout: 1 / by[(b, layout)]["tokens_per_s"] for layout in ("standard", "ladder", "upper-bound")}
        expected = (seconds["standard"] - seconds["ladder"]) / (seconds["standard"] - seconds["upper-bound"])
        assert by[(b, "ladder")]["hidden"] == pytest.approx(expected, rel=1e-9)
        assert 0 < expected < 1
        assert all(by[(b, layout)]["hidden"] is None for layout in ("standard", "parallel", "upper-bound"))
        assert by[(b, "ladder")]["tokens_per_s_per_gpu"] == pytest.approx(by[(b, "ladder")]["tokens_per_s"] / 8)


def test_hybrid_lies_between_standard_and_ladder_and_is_each_at_its_ends(capsys):
    def ladder_row(n):
        rows = predict_table("llama-3-70b", GPUS["h100"], get_link("pcie-no-p2p"), 8, [1, 64],
                             ["standard", "ladder"], 1024, 512, ladder_layers=[n])
        return {r["batch_size"]: r for r in rows if r["layout"] == "ladder"}

    whole = {r["batch_size"]: r for r in predict_table("llama-3-70b", GPUS["h100"], get_link("pcie-no-p2p"), 8,
                                                        [1, 64], ["ladder"], 1024, 512)}
    for b in (1, 64):
        assert ladder_row(0)[b]["speedup"] == pytest.approx(1.0, rel=1e-12)  # N=0 is standard
        assert ladder_row(80)[b]["tokens_per_s"] == pytest.approx(whole[b]["tokens_per_s"], rel=1e-12)
        speedups = [ladder_row(n)[b]["speedup"] for n in (0, 20, 40, 60, 79)]
        assert speedups == sorted(speedups) and speedups[0] < speedups[-1]  # every ladder layer hides more
        assert ladder_row(40)[b]["ladder_layers"] == 40 and whole[b]["ladder_layers"] is None
    several = predict_table("llama-3-70b", GPUS["h100"], get_link("pcie-no-p2p"), 8, [1], ["standard", "ladder"],
                            1024, 512, ladder_layers=[60, 20])
    assert [(r["layout"], r["ladder_layers"]) for r in several] == [("standard", None), ("ladder", 60), ("ladder", 20)]
    assert [r["speedup"] for r in several[1:]] == [ladder_row(60)[1]["speedup"], ladder_row(20)[1]["speedup"]]
    out = ladder_in_process(capsys, "predict", "--interconnect", "pcie-no-p2p", "--batch-sizes", "1",
                            "--ladder-layers", "40,80")
    assert out.returncode == 0 and "ladder on the last N layers" in out.stdout
    assert "ladder[40]" in out.stdout and "ladder[80]" in out.stdout


def test_what_fits_in_memory_is_what_the_paper_could_run():
    """The paper's 70B table has no TP-1 rows and stops at batch 4 on TP 2: those are the configurations
    whose one rank needs more than the H100's usable memory by `ladder bench`'s estimate."""
    published = {(r["tp"], r["batch_size"]) for r in paper_table()}
    for tp in (1, 2, 4, 8):
        rows = predict_table("llama-3-70b", GPUS["h100"], get_link("nvlink-h100"), tp, [1, 4, 16, 64],
                             ["standard"], 1024, 512)
        for r in rows:
            assert r["fits"] == ((tp, r["batch_size"]) in published), (tp, r["batch_size"])


def test_predict_marks_the_rows_that_do_not_fit(capsys):
    out = ladder_in_process(capsys, "predict", "--preset", "llama-3-70b", "--tp", "1,8", "--batch-sizes", "1",
                     "--layouts", "standard,ladder")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("nvlink-h100")]
    assert [row[1] for row in rows if "does not fit" in " ".join(row)] == ["1", "1"]
    assert all(float(row[4]) > 0 for row in rows if row[1] == "8")
    assert "does not fit: one rank needs more than 90% of one h100's 79.6 GiB" in out.stdout


def test_a_six_digit_batch_keeps_its_own_column():
    from ladder.cli.predict import format_predictions

    rows = predict_table("llama-3-70b", GPUS["h100"], get_link("nvlink-h100"), 8, [1, 100000], ["standard"],
                         1024, 512)
    lines = format_predictions(rows).splitlines()
    assert [line.split()[1:3] for line in lines] == [["tp", "batch"], ["8", "1"], ["8", "100000"]]


def test_every_prediction_states_the_validated_accuracy(capsys):
    out = ladder_in_process(capsys, "predict", "--preset", "llama-3-8b", "--interconnect", "nvlink-h100", "--tp", "8",
                     "--batch-sizes", "1")
    assert out.returncode == 0, out.stderr
    report = validate()
    within = sum(p["within"] for p in report["points"])
    worst = max(abs(p["error"]) for p in report["points"])
    footer = out.stdout.split("accuracy: ")[1]
    assert f"on {within}/{len(report['points'])} held-out llama-3-70b points (worst off by {worst:.2f})" in footer
    for name, setting in UNSEEN_SETTINGS.items():
        unseen = validate_unseen(setting)
        assert f"{sum(p['within'] for p in unseen['points'])}/{len(unseen['points'])} on {name}" in footer


def test_a_custom_gpu_is_the_roofline_of_its_numbers():
    """`--gpu custom` with the H100's own numbers predicts what h100 does; more memory bandwidth speeds up
    the memory-bound batch-1 decode, fewer FLOP/s slow down the compute-bound batch-64 prefill, and less
    memory turns the rows that no longer fit."""
    h100 = GPUS["h100"]
    table = lambda gpu: predict_table("llama-3-70b", gpu, get_link("nvlink-h100"), 8, [1, 64], ["standard"], 1024, 512)
    as_given = get_gpu("custom", h100.hbm_bytes_per_s / 1e12, h100.bf16_flops_per_s / 1e12, h100.memory_bytes / 2**30)
    assert [r["tokens_per_s"] for r in table(as_given)] == pytest.approx([r["tokens_per_s"] for r in table(h100)])
    (b1, b64) = table(h100)
    (faster_memory_b1, _) = table(get_gpu("h100", memory_tbps=2 * h100.hbm_bytes_per_s / 1e12))
    (_, fewer_flops_b64) = table(get_gpu("h100", tflops=h100.bf16_flops_per_s / 1e12 / 4))
    assert faster_memory_b1["tokens_per_s"] > 1.3 * b1["tokens_per_s"]
    assert fewer_flops_b64["tokens_per_s"] < 0.8 * b64["tokens_per_s"]
    assert [r["fits"] for r in table(get_gpu("h100", memory_gib=24))] == [True, False]  # 20.0 and 30.4 GiB


def test_predict_on_another_gpu_says_the_accuracy_is_the_h100s(capsys):
    out = ladder_in_process(capsys, "predict", "--gpu", "custom", "--gpu-memory-tbps", "4", "--gpu-tflops", "148",
                     "--gpu-memory-gib", "96", "--batch-sizes", "1", "--layouts", "standard,ladder")
    assert out.returncode == 0, out.stderr
    assert "llama-3-70b on custom (4 TB/s, 148 TFLOP/s, 96 GiB)" in out.stdout
    assert "all on H100s; on custom the H100's fitted efficiencies and overheads are assumed" in out.stdout
    assert "all on H100s" not in ladder_in_process(capsys, "predict", "--batch-sizes", "1").stdout


def test_predict_reads_a_checkpoints_shape_from_its_config_json_alone(tmp_path, capsys):
    """A user predicting a model too large to download needs only its config.json: the shape read from
    it predicts what the preset of that shape does, under the checkpoint's name."""
    from ladder.checkpoint.hf_config import config_to_hf
    from ladder.checkpoint.resolve import read_shape

    folder = tmp_path / "Meta-Llama-3-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_to_hf(get_preset("llama-3-70b"))))
    rows = lambda name, config=None: predict_table(name, GPUS["h100"], get_link("pcie-no-p2p"), 8, [1, 64],
                                                   ["standard", "ladder"], 1024, 512, config=config)
    from_checkpoint = rows("Meta-Llama-3-70B", read_shape(str(folder / "config.json")))
    assert from_checkpoint == [{**r, "preset": "Meta-Llama-3-70B"} for r in rows("llama-3-70b")]
    out = ladder_in_process(capsys, "predict", "--model", str(folder), "--tp", "8", "--batch-sizes", "1,64", "--layouts",
                     "standard,ladder", "--interconnect", "pcie-no-p2p", "--json")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == json.loads(json.dumps(from_checkpoint))


def test_predict_of_a_checkpoint_that_is_not_a_llama_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
    out = ladder_in_process(capsys, "predict", "--model", str(tmp_path / "config.json"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "model_type 'mistral'" in out.stderr and "not supported" in out.stderr


def test_validate_json_is_the_report_of_the_api(capsys):
    out = ladder_in_process(capsys, "predict", "--validate", "--json")
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["held_out"] == json.loads(json.dumps(validate()))
    assert printed["unseen"] == json.loads(json.dumps({name: validate_unseen(s) for name, s in UNSEEN_SETTINGS.items()}))


@pytest.mark.parametrize("args,message", [
    (["--batch-sizes", "0"], "batch sizes, --prompt-len and --gen-len must be >= 1"),
    (["--gen-len", "0"], "batch sizes, --prompt-len and --gen-len must be >= 1"),
    (["--tp", "3"], "ffn_hidden 28672 is not divisible by tensor-parallel degree 3"),
    (["--gpu", "b300"], "unknown gpu 'b300'; known: h100, h200, a100, custom"),
    (["--gpu", "custom", "--gpu-tflops", "148"], "--gpu custom needs --gpu-memory-tbps, --gpu-memory-gib"),
    (["--gpu", "h100", "--gpu-memory-gib", "0"], "--gpu-memory-gib must be > 0, got 0"),
    (["--interconnect", "real"], "ladder predict needs a link model"),
    (["--layouts", "ladder,desync"], "the cost model knows standard, parallel, ladder and upper-bound, not 'desync'"),
    (["--ladder-layers", "81"], "--ladder-layers must be between 0 and llama-3-70b's 80 layers, got 81"),
    (["--ladder-layers", "40", "--layouts", "standard,parallel"], "--ladder-layers 40 makes the ladder layout hybrid"),
    (["--ladder-layers", "20,81"], "--ladder-layers must be between 0 and llama-3-70b's 80 layers, got 81"),
    (["--ladder-layers", "20,20"], "--ladder-layers lists 20 twice"),
    (["--interconnect", "nvlink-h100", "--link-bandwidth-gbps", "0"], "--link-bandwidth-gbps must be > 0, got 0"),
])
def test_predict_bad_input_is_one_line(args, message, capsys):
    out = ladder_in_process(capsys, "predict", "--preset", "llama-3-70b", "--interconnect", "nvlink-h100", "--tp", "8", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert message in lines[0]


def test_link_calibration_takes_the_rows_it_is_told():
    """The cross-validation (experiments/costmodel/crossval.py) refits the links without one cell."""
    from ladder.predict.paper import paper_measurements
    assert paper_measurements("off", lambda tp, batch: batch in TRAIN_BATCHES) == paper_measurements("off")
    every = paper_measurements("off", lambda tp, batch: True)
    without = paper_measurements("off", lambda tp, batch: (tp, batch) != (8, 4))
    assert len(every) == 1 + 10 and len(without) == 1 + 9  # the NCCL measurement + one per (TP, batch) cell
    decode_message = lambda m: m[1][-1][1]  # (tp, [(prefill), (decode: count, bytes)], us)
    left_out = [m for m in every[1:] if m[0] == 8 and decode_message(m) == 4 * 8192 * 2]
    assert [m for m in every if m not in without] == left_out
