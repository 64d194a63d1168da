"""Faults while writing and reading, injected for real: a file-size limit (RLIMIT_FSIZE: writes past it fail
with EFBIG, Python ignoring SIGXFSZ), an OS error raised from the write path, a full tmpfs where the
machine lets us mount one, and files cut short or removed. Each is one line and a non-zero exit, leaves no
partial file or folder, and keeps the older outputs whole."""

import contextlib
import errno
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ladder.errors import LadderError
from ladder.files import append_line, check_room, safetensors_damage, write_cause, write_text
from ladder.train.checkpoints import checkpoint_damage, checkpoint_dirs

from helpers import ladder_in_fixture, ladder_in_process

TRAIN = ["train", "preset=tiny", "seq_len=32", "batch_size=4", "micro_batch_size=4", "eval_every=100",
         "data=shakespeare:heldout", "heldout=none", "--no-progress"]


@contextlib.contextmanager
def file_size_limit(limit: int):
    """This process may not grow a file past `limit` bytes (the soft limit, restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def limited(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def ladder_limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    """`ladder ARGS` in a process that may not write a file past `limit` bytes."""
    return subprocess.run([sys.executable, "-m", "ladder", *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=limited(limit))


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("ladder:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def error_line(stderr: str) -> str:
    """The one error line of a command that may have said what it loaded before it failed."""
    lines = [line for line in stderr.splitlines() if line.startswith("ladder: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*") if p.name.startswith(".") and ("tmp" in p.name or "old" in p.name))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run with checkpoints at steps 3 and 6 (each about 2.5 MB: weights 0.8, optimizer 1.7)."""
    out = tmp_path_factory.mktemp("run") / "run"
    done = ladder_in_fixture(*TRAIN, "steps=6", "checkpoint_every=3", f"out_dir={out}")  # one rank: no workers
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def copy_run(run: Path, to: Path) -> Path:
    import shutil
    shutil.copytree(run, to)
    return to


# ---- writing ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_checkpoint_past_the_file_size_limit_is_one_line_and_the_older_ones_stay_whole(run, tmp_path):
    out = copy_run(run, tmp_path / "run")
    before = {p.name: checkpoint_damage(p) for p in checkpoint_dirs(out)}
    done = ladder_limited(1_000_000, *TRAIN, "steps=9", "checkpoint_every=3", f"out_dir={out}", "--resume")
    assert done.returncode != 0
    line = one_line(done.stderr)
    assert "optimizer-rank0.pt" in line and "file-size limit" in line, line
    assert {p.name: checkpoint_damage(p) for p in checkpoint_dirs(out)} == before == {"step-000003": None,
                                                                                     "step-000006": None}
    assert leftovers(out) == []
    assert (out / "metrics.jsonl").read_text().endswith("\n")  # the steps before the checkpoint, whole lines


def test_a_full_disk_is_refused_before_the_checkpoint_is_written(run, tmp_path, monkeypatch, capsys):
    out = copy_run(run, tmp_path / "run")
    import shutil
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1_000_000))
    said = ladder_in_process(capsys, *TRAIN, "steps=9", "checkpoint_every=3", f"out_dir={out}", "--resume")
    assert said.returncode != 0
    line = one_line(said.stderr)
    assert "not enough space" in line and "checkpoint step-000009" in line and "1.0 MB are free" in line, line
    assert [p.name for p in checkpoint_dirs(out)] == ["step-000003", "step-000006"] and leftovers(out) == []


@pytest.mark.slow
def test_a_real_full_disk_says_no_space(tmp_path):
    """The issue's own case, a 3 MB file system, where this machine lets the tests mount one."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        done = subprocess.run([sys.executable, "-m", "ladder", *TRAIN, "steps=6", "checkpoint_every=3",
                               f"out_dir={mount / 'run'}"], capture_output=True, text=True, timeout=300)
        assert done.returncode != 0
        line = one_line(done.stderr)
        assert "not enough space" in line or "no space left" in line, line
        assert [p.name for p in checkpoint_dirs(mount / "run")] == ["step-000003"]
        assert checkpoint_damage(mount / "run" / "checkpoints" / "step-000003") is None
        assert leftovers(mount) == []
        converted = subprocess.run([sys.executable, "-m", "ladder", "convert", "smollm2-135m-instruct",
                                    "--ladder-layers", "8", "--out", str(mount / "conv")], capture_output=True,
                                   text=True, timeout=300)
        assert converted.returncode != 0 and "not enough space" in one_line(converted.stderr)
        assert not (mount / "conv").exists() and leftovers(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_convert_over_an_existing_folder_that_fails_keeps_the_old_folder(tmp_path, monkeypatch, capsys):
    out = tmp_path / "conv"
    first = ladder_in_process(capsys, "convert", "smollm2-135m-instruct", "--ladder-layers", "4", "--out", str(out))
    assert first.returncode == 0, first.stderr
    old = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "model.safetensors"}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("ladder.checkpoint.hf.save_file", full_disk)
    said = ladder_in_process(capsys, "convert", "smollm2-135m-instruct", "--ladder-layers", "8", "--out", str(out),
                             "--force")
    assert said.returncode != 0
    line = error_line(said.stderr)
    assert str(out) in line and "no space left" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "model.safetensors"} == old
    assert json.loads((out / "config.json").read_text())["ladder_layers"] == 4 and leftovers(tmp_path) == []


def test_an_appended_line_past_the_limit_leaves_the_file_as_it_was(tmp_path):
    results = tmp_path / "bench.jsonl"
    results.write_text('{"a": 1}\n')
    with file_size_limit(results.stat().st_size + 10), pytest.raises(LadderError) as caught:
        append_line(results, json.dumps({"b": "x" * 100}))
    assert "file-size limit" in str(caught.value) and str(results) in str(caught.value)
    assert results.read_text() == '{"a": 1}\n'


def test_a_text_file_past_the_limit_is_not_written_and_the_old_one_stays(tmp_path):
    out = tmp_path / "scores.json"
    out.write_text("old\n")
    with file_size_limit(20), pytest.raises(LadderError, match="file-size limit"):
        write_text(out, "x" * 100)
    assert out.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["scores.json"]


@pytest.mark.slow
def test_a_picture_past_the_limit_is_one_line(run, tmp_path):
    picture = tmp_path / "loss.png"
    done = ladder_limited(5_000, "train", "plot", str(run), "--out", str(picture))
    assert done.returncode != 0 and "file-size limit" in one_line(done.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("said,cause", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left"),
    (OSError(errno.EACCES, "Permission denied"), "no permission"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only"),
    (RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left "
                  "on device\" })"), "no space left"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 586624 vs 586516"), "cut short"),
    (ValueError("a bug, not the disk"), None),
])
def test_the_cause_is_read_from_the_error_or_its_wrappers(said, cause, tmp_path):
    found = write_cause(said, tmp_path / "x")
    assert (found is None) if cause is None else (cause in found)


def test_room_is_refused_in_one_line_with_both_numbers(tmp_path):
    with pytest.raises(LadderError, match=r"not enough space in .* for a test: it needs about 10000000.0 GB, .* are free"):
        check_room(tmp_path, 10**16, "a test")


# ---- reading -------------------------------------------------------------------------------------------

def cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize("damage,said", [
    (lambda c: cut(c / "optimizer-rank0.pt"), "optimizer-rank0.pt is cut short"),
    (lambda c: (c / "optimizer-rank0.pt").unlink(), "optimizer-rank0.pt is missing"),
    (lambda c: cut(c / "model.safetensors"), "model.safetensors is cut short"),
    (lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda c: (c / "trainer_state.json").write_text('{"step": 6, "wor'), "trainer_state.json is missing or cut short"),
])
def test_resume_passes_over_a_damaged_newest_checkpoint_and_says_why(run, tmp_path, damage, said, capsys):
    out = copy_run(run, tmp_path / "run")
    newest = checkpoint_dirs(out)[-1]
    damage(newest)
    assert checkpoint_damage(newest) == said
    resumed = ladder_in_process(capsys, *TRAIN, "steps=7", "checkpoint_every=3", f"out_dir={out}", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    line = one_line(resumed.stderr)
    assert "resuming from step-000003" in line and said in line, line
    assert [p.name for p in checkpoint_dirs(out)][-1] == "step-000007"


def test_resume_with_every_checkpoint_damaged_names_each_file(run, tmp_path, capsys):
    out = copy_run(run, tmp_path / "run")
    for checkpoint in checkpoint_dirs(out):
        cut(checkpoint / "optimizer-rank0.pt")
    resumed = ladder_in_process(capsys, *TRAIN, "steps=9", f"out_dir={out}", "--resume")
    assert resumed.returncode != 0
    line = one_line(resumed.stderr)
    assert "no whole checkpoint" in line and "step-000006: optimizer-rank0.pt is cut short" in line, line


def test_a_model_file_cut_short_is_one_line_when_read(run, tmp_path, capsys):
    out = copy_run(run, tmp_path / "run")
    newest = checkpoint_dirs(out)[-1]
    cut(newest / "model.safetensors", 0.9)
    assert safetensors_damage(newest / "model.safetensors") == "is cut short"
    said = ladder_in_process(capsys, "generate", "--model", str(newest), "--prompt", "to be", "--max-new-tokens", "2")
    assert said.returncode != 0 and "model.safetensors" in one_line(said.stderr)
