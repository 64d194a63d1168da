"""Training: golden losses, bit-exact resume, world size 2 = 1, frozen layers, one-line errors."""

import dataclasses
import json
import re
import signal
import socket

import pytest
import torch

from ladder.comm.launch import launch
from ladder.errors import LadderError
from ladder.train import loop
from ladder.train.checkpoints import checkpoint_dirs
from ladder.train.loop import train
from ladder.train.settings import TrainConfig, load_train_config

from helpers import (descendants, has_loaded_torch, ladder_in_process, ladder_lines, python_docs_corpus,
                     stop_when_ready, torchrun_on_two_nodes)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return python_docs_corpus(tmp_path_factory.mktemp("corpus"), 120_000, 30_000)


def tiny_config(corpus, out, **changes) -> TrainConfig:
    config = TrainConfig(preset="tiny", data=[str(corpus / "train.txt")], heldout=[str(corpus / "heldout.txt")],
                         seq_len=32, steps=6, batch_size=8, micro_batch_size=4, lr=3e-3, min_lr=3e-4,
                         warmup_steps=2, checkpoint_every=3, eval_every=3, eval_batches=2, out_dir=str(out),
                         device="cpu")
    return dataclasses.replace(config, **changes)


# Regression values: the first six losses of the config above (seed 0, fp32 CPU, torch 2.13). Byte-level
# loss starts at ln(256) = 5.545 for a random model; these move only if the model, init, data order or
# optimizer change. Tolerance 1e-4 absorbs BLAS differences between CPUs, not a changed computation.
GOLDEN = [5.550100, 5.321469, 5.119264, 4.879678, 4.755015, 4.644671]


def test_golden_losses(corpus, tmp_path):
    result = train(tiny_config(corpus, tmp_path / "run"), progress=False)
    assert result.losses == pytest.approx(GOLDEN, abs=1e-4)


def test_resume_equals_uninterrupted(corpus, tmp_path):
    full = train(tiny_config(corpus, tmp_path / "full"), progress=False)
    first = train(tiny_config(corpus, tmp_path / "split", stop_at=3), progress=False)
    assert [int(p.name.split("-")[1]) for p in checkpoint_dirs(tmp_path / "split")] == [3]
    second = train(tiny_config(corpus, tmp_path / "split"), resume=True, progress=False)
    assert first.losses + second.losses == full.losses  # bit-exact, not approximately
    a = json.loads((full.final_dir / "config.json").read_text())
    assert a == json.loads((second.final_dir / "config.json").read_text())
    from safetensors.torch import load_file
    wa, wb = load_file(full.final_dir / "model.safetensors"), load_file(second.final_dir / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_a_ladder_run(corpus, tmp_path):
    # The checkpoint spells "ladder on every layer" as ladder_layers = n_layers, the config as None.
    train(tiny_config(corpus, tmp_path / "run", layout="ladder", steps=3, stop_at=2), progress=False)
    resumed = train(tiny_config(corpus, tmp_path / "run", layout="ladder", steps=3), resume=True, progress=False)
    assert len(resumed.losses) == 1


def _train_rank(config):
    return train(config, progress=False).losses


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_world_size_2_equals_world_size_1(corpus, tmp_path, parallel):
    one = train(tiny_config(corpus, tmp_path / "one"), progress=False).losses
    two = launch(_train_rank, 2, tiny_config(corpus, tmp_path / f"two-{parallel}", parallel=parallel))
    # Same global batch; the only difference is the order of fp32 gradient sums (per-rank means, then
    # an all-reduce): ~1e-7 relative per step, compounded over six Adam steps. 1e-4 keeps a 100x margin.
    assert two[0] == pytest.approx(one, abs=1e-4)
    assert two[0] == two[1]


def test_desync_with_every_module_reduced_trains_as_standard(corpus, tmp_path):
    # Desync at TP 2 with every module reduced is the standard model written as two simulated ranks: the
    # same losses (to fp32 summation order) show gradients reach the whole weights through the rank slices.
    config = tiny_config(corpus, tmp_path / "run", layout="desync", desync_reduce="all", desync_tp=2)
    assert train(config, progress=False).losses == pytest.approx(GOLDEN, abs=1e-4)


def _desync_logits_on_real_ranks(folder, tokens):
    from ladder.comm.distributed import init_distributed, shutdown_distributed
    from ladder.model.spec import ModelSpec

    ctx = init_distributed("cpu", timeout_s=120)
    try:
        loaded = ModelSpec(model=str(folder), tp=2, device="cpu").load(ctx.communicator(), ctx.device)
        with torch.no_grad():
            return loaded.model(tokens)
    finally:
        shutdown_distributed()


def test_desync_checkpoint_runs_on_its_real_ranks(corpus, tmp_path):
    from ladder.checkpoint.hf import open_hf
    from ladder.comm.base import LocalCommunicator
    from ladder.model.spec import ModelSpec
    from ladder.train.simulate import SimulatedRanks
    from ladder.model.weights import build_model, load_weights

    result = train(tiny_config(corpus, tmp_path / "run", layout="desync", steps=3), progress=False)
    saved = json.loads((result.final_dir / "config.json").read_text())
    assert (saved["residual_layout"], saved["desync_tp"], saved["desync_reduce"]) == ("desync", 2, "mlp")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    checkpoint = open_hf(result.final_dir)
    whole = build_model(checkpoint.config, LocalCommunicator(), torch.device("cpu"))
    load_weights(whole, checkpoint.source)
    with torch.no_grad():
        simulated = SimulatedRanks(whole, 2)(tokens)
    real = launch(_desync_logits_on_real_ranks, 2, result.final_dir, tokens)
    torch.testing.assert_close(real[0], simulated, atol=2e-5, rtol=0)  # as in test_tp.py
    with pytest.raises(LadderError, match="trained for tensor-parallel degree 2.*--tp 2"):
        ModelSpec(model=str(result.final_dir), tp=1, device="cpu").load(LocalCommunicator(), torch.device("cpu"))


def test_checkpoint_is_a_model_folder_the_cli_runs(corpus, tmp_path, capsys):
    result = train(tiny_config(corpus, tmp_path / "run", steps=3), progress=False)
    out = ladder_in_process(capsys, "generate", "--model", str(result.final_dir), "--prompt", "def ",
                            "--max-new-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert "HF weights" in out.stderr


def test_adaptation_with_frozen_layers(corpus, tmp_path):
    base = train(tiny_config(corpus, tmp_path / "base", steps=3), progress=False).final_dir
    adapted = train(tiny_config(corpus, tmp_path / "adapted", preset=None, model=str(base), ladder_layers=2,
                                trainable="converted", steps=3), progress=False).final_dir
    from safetensors.torch import load_file
    before, after = load_file(base / "model.safetensors"), load_file(adapted / "model.safetensors")
    frozen = [k for k in before if not k.startswith(("model.layers.2.", "model.layers.3."))]
    trained = [k for k in before if k.startswith(("model.layers.2.", "model.layers.3.")) and "norm" not in k]
    assert frozen and trained
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(not torch.equal(before[k], after[k]) for k in trained)
    assert json.loads((adapted / "config.json").read_text())["ladder_layers"] == 2


def test_bad_input(corpus, tmp_path):
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(LadderError, match="is empty"):
        train(tiny_config(corpus, tmp_path / "a", data=[str(tmp_path / "empty.txt")]), progress=False)
    with pytest.raises(LadderError, match="no data file or folder at /no/such.txt"):
        train(tiny_config(corpus, tmp_path / "b", data=["/no/such.txt"]), progress=False)
    with pytest.raises(LadderError, match="seq_len 300 exceeds the model's context"):
        train(tiny_config(corpus, tmp_path / "c", seq_len=300), progress=False)
    with pytest.raises(LadderError, match="upper-bound layout never re-synchronises"):
        train(tiny_config(corpus, tmp_path / "e", layout="upper-bound"), progress=False)
    with pytest.raises(LadderError, match="n_heads 4 with n_kv_heads 2 cannot be sharded over tensor-parallel degree 3"):
        train(tiny_config(corpus, tmp_path / "e", layout="desync", desync_tp=3), progress=False)
    with pytest.raises(LadderError, match="unknown config key 'learning_rate'"):
        load_train_config(None, ["learning_rate=1e-3"])
    train(tiny_config(corpus, tmp_path / "d", steps=3), progress=False)
    with pytest.raises(LadderError, match="another shape or layout"):
        train(tiny_config(corpus, tmp_path / "d", steps=6, layout="ladder"), resume=True, progress=False)
    with pytest.raises(LadderError, match="already holds checkpoints"):
        train(tiny_config(corpus, tmp_path / "d", steps=6), progress=False)
    leftovers = [p.name for p in (tmp_path / "d" / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no half-written checkpoint


@pytest.mark.parametrize("computes_in_bf16", [False, True])
def test_bf16_on_a_cpu_without_bf16_arithmetic_is_said_in_one_line(corpus, tmp_path, capsys, monkeypatch,
                                                                    computes_in_bf16):
    monkeypatch.setattr(loop, "cpu_computes_in_bf16", lambda: computes_in_bf16)
    train(tiny_config(corpus, tmp_path / "run", steps=1, precision="bf16", heldout=[]), progress=False)
    warned = [line for line in capsys.readouterr().err.splitlines() if "bf16 arithmetic" in line]
    assert len(warned) == (0 if computes_in_bf16 else 1)


def test_an_out_dir_under_a_file_is_one_line_before_training(tmp_path, capsys):
    (tmp_path / "a_file").write_text("precious")
    out = ladder_in_process(capsys, "train", f"out_dir={tmp_path / 'a_file' / 'run'}", "--no-progress")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"ladder: error: cannot write {tmp_path / 'a_file' / 'run' / 'metrics.jsonl'}: "
        f"{tmp_path / 'a_file'} is a file, not a folder"], out.stderr
    assert (tmp_path / "a_file").read_text() == "precious"


def test_config_file_and_cli(corpus, tmp_path, capsys):
    (tmp_path / "run.toml").write_text(f'preset = "tiny"\ndata = ["{corpus / "train.txt"}"]\nheldout = []\n'
                                       f'seq_len = 32\nsteps = 2\nbatch_size = 4\nmicro_batch_size = 4\n')
    out = ladder_in_process(capsys, "train", "--config", str(tmp_path / "run.toml"), f"out_dir={tmp_path / 'cli'}",
                            "warmup_steps=1", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "final train loss" in out.stdout
    plot = ladder_in_process(capsys, "train", "plot", str(tmp_path / "cli"), "--out", str(tmp_path / "loss.png"))
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    bad = ladder_in_process(capsys, "train", "steps=abc")
    assert bad.returncode == 2 and bad.stderr.strip() == "ladder: error: steps expects an integer, got 'abc'"


def test_train_plot_of_a_folder_that_holds_no_training_metrics_is_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"status": "ok", "layout": "ladder"}\n')  # a bench record
    plot = ladder_in_process(capsys, "train", "plot", str(tmp_path / "run"), "--out", str(tmp_path / "loss.png"))
    assert plot.returncode == 2 and plot.stderr.strip() == (
        f"ladder: error: {tmp_path / 'run' / 'metrics.jsonl'}:1 is not a ladder train record (it has no tokens and loss)")


@pytest.mark.parametrize("override,message", [
    ("lr=-1", "lr must be > 0, got -1.0"),
    ("lr=nan", "lr must be > 0, got nan"),
    ("keep_checkpoints=0", "keep_checkpoints must be > 0, got 0"),  # checkpoint_dirs[:-0] deletes nothing: every checkpoint kept
    ("checkpoint_every=0", "checkpoint_every must be > 0, got 0"),
    ("eval_every=0", "eval_every must be > 0, got 0"),
    ("warmup_steps=-3", "warmup_steps must be >= 0, got -3"),
    ("min_lr=1", "min_lr 1 is above lr 0.003"),
    ("beta2=1", "beta2 must be in [0, 1), got 1.0"),
])
def test_settings_out_of_range_are_refused_before_training(override, message):
    with pytest.raises(LadderError, match=re.escape(message)):
        load_train_config(None, [override])


def test_settings_may_come_before_and_after_options(capsys):
    from ladder.cli.main import main

    assert main(["train", "steps=5", "--no-progress", "lr=-1", "--nproc", "1", "min_lr=0"]) == 2
    assert capsys.readouterr().err.strip() == "ladder: error: lr must be > 0, got -1.0"  # lr=-1 was read
    with pytest.raises(SystemExit):
        main(["train", "--no-progress", "lr=1", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_nproc_below_one_is_one_line(capsys):
    bad = ladder_in_process(capsys, "train", "--nproc", "0")
    assert bad.returncode == 2 and bad.stderr.strip() == "ladder: error: --nproc must be >= 1, got 0"


@pytest.mark.parametrize("sig,status,said", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_a_stop_signal_saves_every_rank_and_says_where_in_one_line(sig, status, said, tmp_path):
    # Ctrl-C reaches the terminal's whole process group (the launcher and both data-parallel workers);
    # a scheduler's SIGTERM, the launcher alone, which passes it on.
    out_dir = tmp_path / "run"
    metrics = out_dir / "metrics.jsonl"
    returncode, stderr = stop_when_ready(
        ["train", "--nproc", "2", "--no-progress", "steps=100000", f"out_dir={out_dir}", "checkpoint_every=100000",
         "eval_every=100000"],
        lambda pid: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, sig)
    assert returncode == status, stderr
    assert "Traceback" not in stderr
    said_line = rf"ladder: {said}: saved step (\d+) to {re.escape(str(out_dir))}/checkpoints; continue with --resume"
    matches = [m for m in (re.fullmatch(said_line, line) for line in stderr.splitlines()) if m]
    assert len(matches) == 1, stderr
    step = int(matches[0].group(1))
    assert step >= 3 and [p.name for p in checkpoint_dirs(out_dir)] == [f"step-{step:06d}"]


def test_a_rank_that_stopped_ignores_the_signal_its_launcher_passes_on_later(monkeypatch):
    # The launcher forwards its own Ctrl-C, at times only once the ranks have saved and are leaving the
    # loop: under load in CI, that one became a bare KeyboardInterrupt and the "saved step" line was lost.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = loop._StopRequest()
        signal.raise_signal(signal.SIGINT)  # the terminal's
        stop.restore()
        try:
            signal.raise_signal(signal.SIGINT)  # the launcher's, late
        except KeyboardInterrupt:
            pytest.fail("the launcher's late Ctrl-C reached a rank that had already saved")
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert stop.signum == signal.SIGINT


def test_ctrl_c_while_the_workers_start_is_one_line(tmp_path):
    # Before training can catch a stop, the fork server and the workers spend seconds importing torch.
    returncode, stderr = stop_when_ready(
        ["train", "--nproc", "2", "--no-progress", "steps=100000", f"out_dir={tmp_path / 'run'}"],
        lambda pid: any(has_loaded_torch(p) for p in descendants(pid)), signal.SIGINT)
    assert returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("ladder: interrupted"), stderr


def test_two_nodes_train_as_one_process_does(corpus, tmp_path):
    """Two torchrun agents, one rank each (as on two machines sharing a folder): data parallel over
    the nodes gives the losses of one process, and one checkpoint that both ranks wrote into."""
    settings = {f.name: getattr(tiny_config(corpus, tmp_path / "run"), f.name) for f in dataclasses.fields(TrainConfig)}
    args = ["train", "--no-progress", *(f"{k}={','.join(v) if isinstance(v, list) else v}"
                                        for k, v in settings.items() if v is not None)]
    nodes = torchrun_on_two_nodes([args, args])
    assert [status for status, _, _ in nodes] == [0, 0], nodes[0][2][-3000:] + nodes[1][2][-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(GOLDEN, abs=1e-4)  # (the tolerance of test_world_size_2_equals_world_size_1)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-000003", "step-000006"]
    assert {p.name for p in (tmp_path / "run" / "checkpoints" / "step-000006").glob("optimizer-rank*.pt")} == {
        "optimizer-rank0.pt", "optimizer-rank1.pt"}


def test_two_nodes_without_a_shared_out_dir_stop_before_training(tmp_path):
    """Each rank writes its optimizer state into out_dir: on two machines without a shared folder the
    first checkpoint failed (a traceback) after training up to it."""
    args = ["train", "steps=6", "checkpoint_every=3", "out_dir=run", "--no-progress"]
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    nodes = torchrun_on_two_nodes([args, args], [tmp_path / "node0", tmp_path / "node1"])
    for status, _, err in nodes:
        assert status != 0
        assert ladder_lines(err) == [
            f"ladder: error: out_dir run is not one folder for every rank: rank 1 (on {socket.gethostname()}) does "
            "not see what rank 0 wrote there; put it on a filesystem every node shares"], err[-3000:]
    assert list((tmp_path / "node0" / "run").iterdir()) == []  # no step ran; the check left nothing behind


def test_two_nodes_given_different_settings_stop_before_training(tmp_path):
    # With another lr, rank 1 would apply the averaged gradients differently: the replicas drift apart.
    args = ["train", "steps=2", f"out_dir={tmp_path / 'run'}", "--no-progress"]
    nodes = torchrun_on_two_nodes([args, [*args, "lr=1e-3"]])
    for rank, (status, _, err) in enumerate(nodes):
        assert status != 0
        assert ladder_lines(err) == [
            f"ladder: error: rank {1 - rank} and rank {rank} have different training settings, data or teacher: "
            "start every node with the same command and the same files"], err[-3000:]
    assert not checkpoint_dirs(tmp_path / "run")


def test_python_source_is_the_standard_librarys_code_and_never_the_held_out_documentation():
    from pydoc_data.topics import topics

    from ladder.train.data import read_texts

    (source,) = read_texts(["python-source"])
    assert "def " in source and "import " in source and len(source) > 1_000_000
    held_out = [text for text in topics.values() if len(text) > 2000]
    assert held_out and not any(text[:2000] in source for text in held_out)
