"""The `ladder` command: real subprocesses, real worker processes, one-line errors."""

import dataclasses
import multiprocessing.spawn
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ladder.cli.main import COMMANDS, build_parser, main
from ladder.comm.distributed import init_distributed, shutdown_distributed
from ladder.comm.launch import launch, quiet_when_the_launcher_is_gone
from ladder.errors import LadderError, Stopped, communication_failure
from ladder.model.config import PRESETS, ModelConfig, default_dtype, get_preset
from ladder.options import CPU_DTYPE
from ladder.train.settings import TrainConfig, load_train_config

from helpers import (descendants, has_loaded_torch, ladder_in_process, ladder_lines, stop_when_ready,
                     torchrun_on_two_nodes)

LADDER = [sys.executable, "-m", "ladder"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*LADDER, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "LADDER_DIST_TIMEOUT": "60"})


def generated(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("generated"))


Completed = subprocess.CompletedProcess


def at_tp1_and_tp2(capsys, layout: str, new_tokens: int) -> tuple[Completed, Completed]:
    """`ladder generate` of the tiny preset's random weights at TP 1 (in this process: TP 1 starts no
    workers) and at TP 2, both successful."""
    args = ["generate", "--preset", "tiny", "--layout", layout, "--prompt-ids", "1,2,3",
            "--max-new-tokens", str(new_tokens)]
    one, two = ladder_in_process(capsys, *args, "--tp", "1"), run(*args, "--tp", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    return one, two


def test_generate_runs_in_the_dtype_this_cpu_picks(capsys, monkeypatch):
    """The suite pins float32 (conftest.py); a user's CPU picks its own (bfloat16 where it computes in bf16).
    Unpinned, `ladder generate` runs in that dtype: the tokens of --dtype <that one>, asked for by name."""
    monkeypatch.delenv(CPU_DTYPE)
    args = ["generate", "--preset", "tiny", "--layout", "ladder", "--prompt-ids", "1,2,3", "--max-new-tokens", "12"]
    picked = ladder_in_process(capsys, *args)
    named = ladder_in_process(capsys, *args, "--dtype", default_dtype("cpu"))
    assert picked.returncode == named.returncode == 0, picked.stderr + named.stderr
    assert generated(picked.stdout) == generated(named.stdout)
    assert len(generated(picked.stdout).split(":")[1].split()) == 12


def test_parallel_layout_runs_from_a_preset(capsys):
    """Random weights can take the parallel layout (a checkpoint with two norms per layer cannot)."""
    one, two = at_tp1_and_tp2(capsys, "parallel", 8)
    assert "layout parallel" in one.stderr
    assert generated(one.stdout) == generated(two.stdout)


def test_generate_batch_with_sampling():
    out = run("generate", "--preset", "tiny", "--layout", "ladder", "--ladder-layers", "2", "--tp", "2",
              "--shard-vocab", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6", "--max-new-tokens", "5",
              "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("generated[")]
    assert len(rows) == 2 and all(len(r.split(":")[1].split()) == 5 for r in rows)


@pytest.mark.parametrize("args,message", [
    (["--preset", "tiny", "--tp", "3"], "n_heads 4 with n_kv_heads 2 cannot be sharded over tensor-parallel degree 3"),
    (["--preset", "llama-3-70b", "--tp", "12"],
     "n_heads 64 with n_kv_heads 8 cannot be sharded over tensor-parallel degree 12 "
     "(this shape shards over tp 1, 2, 4, 7, 8, 16, 32, 64)"),
    (["--preset", "llama-3-70b", "--tp", "3"], "ffn_hidden 28672 is not divisible by tensor-parallel degree 3"),
    (["--preset", "nope"], "unknown preset 'nope'; known presets: tiny"),
    (["--layout", "zigzag"], "unknown layout 'zigzag'; known layouts: standard"),
    (["--max-new-tokens", "200"], "= 203 exceeds the model's max_seq_len 128"),
    (["--ladder-layers", "9"], "ladder_layers must be between 0 and n_layers=4, got 9"),
    (["--ladder-layers", "-1"], "ladder_layers must be between 0 and n_layers=4, got -1"),
    (["--preset", "llama-3-70b", "--tp", "64"], "--tp 64 needs 64 processes"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--stop-ids", "2,x"], "--stop-ids must be comma-separated integers"),
    (["--prompt-ids", "1,999"], "token id 999 is outside the vocabulary [0, 256)"),
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--top-p", "2"], "top_p must be in (0, 1], got 2.0"),
    (["--top-k", "0"], "top_k must be >= 1, got 0"),
])
def test_bad_input_is_one_line_and_nonzero(args, message, capsys):
    if "--prompt-ids" not in args:
        args = [*args, "--prompt-ids", "1,2,3"]
    out = ladder_in_process(capsys, "generate", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ladder: error: "), out.stderr
    assert message in lines[0]


def test_the_installed_command_refuses_bad_input_in_one_line_with_status_2():
    """The cases above run `main` in this process; this one goes through the interpreter and `python -m ladder`."""
    out = run("generate", "--preset", "nope", "--prompt-ids", "1,2,3")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.strip() == "ladder: error: unknown preset 'nope'; known presets: " + ", ".join(PRESETS)


def help_of(command: str, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def test_help_says_every_default_that_a_command_would_use(capsys):
    parser = build_parser()
    for command in ("generate", "eval", "bench", "predict", "train"):
        used = vars(parser.parse_args([command] + (["--text", "t.txt"] if command == "eval" else [])))
        text = help_of(command, capsys)
        for option, value in used.items():
            if value is not None and value is not False and option not in ("func", "command", "overrides", "text"):
                assert f"(default: {value})" in text or f"default: {value}" in text, (command, option, value)
    assert "--seed SEED seed of the random weights (default: 0)" in help_of("bench", capsys)


def test_the_command_list_names_every_command_with_its_summary(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens too
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    for name, command in COMMANDS.items():
        assert f"{name} {command.summary}" in listed
        assert " ".join(command.summary.split()) in help_of(name, capsys)  # its own --help says it too


def test_the_command_list_and_an_unknown_command_import_no_command_and_no_torch():
    """`ladder --help` (and `ladder serv`) answers from the command table alone: no command's module is
    imported, nor torch, which is 2 s of a start on two cores. A new interpreter: this one has torch."""
    code = ("import sys\nfrom ladder.cli.main import main\nfor argv in (['--help'], ['serv']):\n"
            "    try:\n        main(argv)\n    except SystemExit as exc:\n        print('exit', exc.code)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('ladder.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines()[-3:] == ["exit 0", "exit 2", "['ladder.cli.main']"], out.stdout + out.stderr
    assert "invalid choice: 'serv'" in out.stderr


@pytest.mark.parametrize("words", [["bench", "plot"], ["bench", "summary"], ["train", "plot"]])
def test_two_word_commands_are_named_as_typed(words, capsys):
    with pytest.raises(SystemExit):
        main([*words, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: ladder {' '.join(words)} ")


def test_train_help_lists_every_setting_with_the_value_it_takes(capsys):
    listed = help_of("train", capsys).split("and their defaults: ")[1].rstrip(".").split(", ")
    assert [item.split("=")[0] for item in listed] == [f.name for f in dataclasses.fields(TrainConfig)]
    assert load_train_config(None, listed) == TrainConfig()  # the listed values, given back, are the defaults


def test_kv_heads_divisibility_names_the_numbers():
    config = ModelConfig(dim=96, n_layers=1, n_heads=12, n_kv_heads=3, ffn_hidden=64, vocab_size=32)
    with pytest.raises(LadderError, match="n_heads 12 with n_kv_heads 3 cannot be sharded over tensor-parallel degree 4"):
        config.check_tp(4)
    config.check_tp(2)  # fewer ranks than KV groups: whole groups, unevenly (2 + 1)
    assert not config.balanced_tp(2) and config.balanced_tp(3)
    with pytest.raises(LadderError, match="ffn_hidden 30 is not divisible by tensor-parallel degree 4"):
        config.replace(n_kv_heads=12, ffn_hidden=30).check_tp(4)
    config.replace(n_kv_heads=1).check_tp(4)  # MQA: the single KV head is replicated


def test_the_listed_degrees_are_exactly_those_that_shard():
    for config in (get_preset("llama-3-70b"), get_preset("smollm2-135m"), get_preset("tiny")):
        valid = config.valid_tp_degrees()
        listed = re.escape(f"(this shape shards over tp {', '.join(map(str, valid))})")
        for tp in range(1, config.n_heads + 2):
            if tp in valid:
                config.check_tp(tp)
            else:
                with pytest.raises(LadderError, match=listed):
                    config.check_tp(tp)
    assert get_preset("smollm2-135m").valid_tp_degrees() == [1, 2, 3]  # 9 heads, 3 KV heads, ffn 1536


def test_ranks_asked_to_run_on_cpu_are_not_counted_against_the_gpus(monkeypatch):
    from ladder.comm.launch import check_launchable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("auto", "cuda", None):
        with pytest.raises(LadderError, match=r"--tp 2 needs 2 GPUs; this machine has 1 \(--device cpu runs"):
            check_launchable(2, device=device)
    check_launchable(2, device="cpu")  # gloo on the CPU cores, as on a machine without a GPU
    with pytest.raises(LadderError, match=r"--nproc 2 needs 2 GPUs; this machine has 1 \(device=cpu runs"):
        check_launchable(2, "--nproc", device="auto")  # ladder train's setting, not an option
    with pytest.raises(LadderError, match="--nproc 100000 needs 100000 processes"):
        check_launchable(100_000, "--nproc", device="cpu")


def _rank1_fails_while_rank0_waits() -> None:
    init_distributed("cpu", timeout_s=60)
    try:
        if dist.get_rank() == 1:
            raise LadderError("rank one broke on purpose")
        dist.barrier()  # rank 0 would wait here forever without the launcher's clean-up
    finally:
        shutdown_distributed()


def test_a_failing_rank_stops_every_rank_without_hanging():
    start = time.monotonic()
    with pytest.raises(LadderError, match="rank 1 failed: rank one broke on purpose"):
        launch(_rank1_fails_while_rank0_waits, 2)
    assert time.monotonic() - start < 50  # well before the 60 s process-group timeout


def _what_rank0_says_when_rank1_dies() -> str | None:
    init_distributed("cpu", timeout_s=30)
    if dist.get_rank() == 1:
        dist.destroy_process_group()  # its connections close, as when it dies
        return None
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        return communication_failure(exc)
    finally:
        shutdown_distributed()
    return "the all-reduce succeeded without rank 1"


def test_a_rank_that_loses_its_peer_says_so_in_one_line():
    said = launch(_what_rank0_says_when_rank1_dies, 2)[0]
    assert said is not None and "\n" not in said, said  # None: the error was not recognised (a traceback)
    assert said.startswith("communication with the other ranks failed (") and said.endswith(
        "); a rank that died or failed says why on its own node"), said
    assert communication_failure(RuntimeError("shape mismatch")) is None  # other errors stay tracebacks


def _stop_the_launcher(launcher_pid: int) -> None:
    os.kill(launcher_pid, signal.SIGTERM)
    time.sleep(60)  # the launcher stops this rank before then


def test_a_launch_stopped_by_a_signal_leaves_no_rendezvous_thread_running():
    # torch's launcher leaves its rendezvous open after a signal. Freed on its own keep-alive thread, the
    # handler's finalizer printed a traceback after the stop line, once in CI.
    with pytest.raises(Stopped) as stopped:
        launch(_stop_the_launcher, 1, os.getpid(), isolate=True)
    assert stopped.value.__context__ is not None  # the launcher's frames, and so its handler, are alive
    assert [t.name for t in threading.enumerate() if t.name.startswith("RendezvousKeepAliveTimer")] == []


def _environment_of_rank() -> tuple[str | None, str | None, str]:
    return os.environ.get("LADDER_TEST_SETTING"), os.environ.get("LADDER_TEST_GONE"), os.environ["RANK"]


@pytest.mark.parametrize("spawn", [False, True], ids=["cpu-fork-server", "spawn-as-on-gpu"])
def test_workers_see_the_environment_of_each_launch(spawn, monkeypatch):
    # Forked workers come from a server started at the first launch: they must not see its environment.
    if spawn:
        monkeypatch.setattr("ladder.comm.launch._start_method", lambda: "spawn")
    monkeypatch.setenv("LADDER_TEST_GONE", "1")
    monkeypatch.setenv("LADDER_TEST_SETTING", "first")
    assert launch(_environment_of_rank, 2) == {0: ("first", "1", "0"), 1: ("first", "1", "1")}
    monkeypatch.delenv("LADDER_TEST_GONE")
    monkeypatch.setenv("LADDER_TEST_SETTING", "second")  # e.g. NCCL_P2P_DISABLE set between two sweeps
    assert launch(_environment_of_rank, 2) == {0: ("second", None, "0"), 1: ("second", None, "1")}


def test_compiled_decode_at_tp2_equals_eager():
    """With int8 weights on each rank's shard (torchao's tensors traced into the compiled step).
    (--compile-layers at TP 2: tests/test_serve.py's TP-2 server, and test_engine.py at TP 1.)"""
    args = ["generate", "--preset", "tiny", "--layout", "ladder", "--ladder-layers", "3", "--tp", "2",
            "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--quantize", "int8"]
    eager, compiled = run(*args), run(*args, "--compile", timeout=300)
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-2000:]
    assert generated(eager.stdout) == generated(compiled.stdout)
    # what was picked, in one line; the compile on a line of its own, before the first token
    assert "float32 activations (LADDER_CPU_DTYPE); eager decode step (--compile decodes faster" in eager.stderr
    assert "compiling the compiled decode step" in compiled.stderr and "ladder: compiled in " in compiled.stderr


# What the two-node test runs at TP 2, and compares with the same command at TP 1 in this process.
TINY_LADDER = ["generate", "--preset", "tiny", "--layout", "ladder", "--prompt-ids", "1,2,3", "--max-new-tokens", "8"]


def test_runs_on_two_nodes_under_torchrun(capsys):
    """Every rank is LOCAL_RANK 0: anything keyed on the local rank instead of the global one (sharding,
    who prints) shows here. (One node, `torchrun --standalone`: test_evaluate.py's and test_bench.py's.)"""
    (status0, out0, err0), (status1, out1, err1) = torchrun_on_two_nodes([[*TINY_LADDER, "--tp", "2"]] * 2)
    assert (status0, status1) == (0, 0), err0[-3000:] + err1[-3000:]
    assert out1 == ""  # only global rank 0 prints
    one = ladder_in_process(capsys, *TINY_LADDER)
    assert generated(out0) == generated(one.stdout)
    assert "RANDOM" in one.stderr and len(generated(one.stdout).split(":")[1].split()) == 8


def test_two_nodes_given_different_prompts_stop_with_one_line_each():
    args = ["generate", "--preset", "tiny", "--tp", "2", "--max-new-tokens", "8", "--prompt-ids"]
    nodes = torchrun_on_two_nodes([[*args, "1,2,3"], [*args, "1,2,4"]])
    for rank, (status, _, err) in enumerate(nodes):
        assert status != 0
        assert ladder_lines(err) == [
            f"ladder: error: rank {1 - rank} and rank {rank} have different options or prompt tokens: start every "
            "node with the same command and the same files"], err[-3000:]


def test_a_node_that_stops_at_bad_input_is_named_on_the_others_in_one_line():
    args = ["generate", "--tp", "2", "--prompt-ids", "1,2"]
    (_, _, err0), (_, _, err1) = torchrun_on_two_nodes([[*args, "--preset", "tiny"], [*args, "--model", "/no/such"]],
                                                       dist_timeout_s=5)
    assert ladder_lines(err1) == [
        "ladder: error: no model file or folder at /no/such (short names: smollm2-135m-instruct)"]
    said = ladder_lines(err0)  # before: a page of DistStoreError
    assert len(said) == 1 and re.fullmatch(r"ladder: error: not all 2 ranks joined within 5 s \(at 127.0.0.1:\d+\); "
                                           r"a rank that failed to start says why on its own node "
                                           r"\(LADDER_DIST_TIMEOUT sets the wait\)", said[0]), err0[-3000:]
    assert "[rank0]: Traceback" not in err0


@pytest.mark.parametrize("sig,status,message", [
    (signal.SIGINT, 130, "ladder: interrupted; the configurations measured before are in "),
    (signal.SIGTERM, 143, "ladder: stopped by SIGTERM; the configurations measured before are in "),
])
def test_a_signal_stops_the_sweep_and_its_workers_in_one_line(sig, status, message, tmp_path):
    # Ctrl-C goes to the terminal's whole process group; a scheduler's SIGTERM to the command alone.
    workers: list[int] = []

    def both_ranks_started(pid: int) -> bool:  # (on CPU a fork server is their parent; it counts as a worker)
        workers[:] = [p for p in descendants(pid) if has_loaded_torch(p)]
        return sum(not descendants(p) for p in workers) >= 2

    returncode, stderr = stop_when_ready(
        ["bench", "--preset", "tiny", "--tp", "2", "--batch-sizes", "1", "--layouts", "standard,ladder", "--runs",
         "100000", "--prompt-len", "4", "--gen-len", "4", "--no-progress", "--out", str(tmp_path / "r.jsonl")],
        both_ranks_started, sig, timeout=60)
    assert returncode == status, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith(message), stderr[-6000:]
    time.sleep(1)
    assert not any(os.path.exists(f"/proc/{p}") and not _is_zombie(p) for p in workers)


def test_a_worker_forked_after_its_launcher_stopped_exits_without_a_traceback(capsys):
    """Ctrl-C while the fork server forks: the worker finds the launcher's pipe closed (or its semaphores
    unlinked) as multiprocessing's start-up reads them. That says nothing; another error prints."""
    read_end, write_end = os.pipe()
    os.close(write_end)  # the launcher is gone
    with pytest.raises(EOFError) as gone:
        multiprocessing.spawn._main(read_end, None)
    with pytest.raises(ValueError) as bug:
        int("x")
    for caught in (gone, bug):
        quiet_when_the_launcher_is_gone(caught.type, caught.value, caught.tb)
    said = capsys.readouterr().err
    assert "EOFError" not in said and "ValueError: invalid literal" in said


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
