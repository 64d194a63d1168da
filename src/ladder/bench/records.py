"""Results files: one JSON line per measured configuration, appended and synced before the next one
starts (a sweep that dies keeps everything measured so far), with the environment it ran in; and
what `--resume` reads back."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from ladder import __version__
from ladder.bench.spec import BenchPoint
from ladder.bench.summary import read_bench_records
from ladder.errors import LadderError, check_creatable
from ladder.files import append_line
from ladder.model.config import cpu_computes_in_bf16, cpu_has_amx
from ladder.options import MEASURED, DecodeStep, environment_value

SCHEMA_VERSION = 1




def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "ladder": __version__,
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {name: value for name in MEASURED if (value := environment_value(name)) is not None},
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    else:
        env["cpu_kind"], env["cpu_flags"] = cpu_kind(), cpu_vector_flags()
    return env


def cpu_kind() -> str:
    """These machines' kinds of CPU, whose fast paths differ: with AMX tiles (bf16 matrix products in
    hardware: oneDNN's and vLLM's bf16 kernels, and ATen's attention, run differently), with AVX-512 BF16
    only, or without bf16 arithmetic (AVX2). Results that depend on it keep a file per kind."""
    if cpu_has_amx():
        return "amx"
    return "avx512-bf16" if cpu_computes_in_bf16() else "avx2"


def cpu_vector_flags() -> list[str]:
    """The CPU's vector and matrix flags (avx*, amx*, fma), from /proc/cpuinfo; [] where it has none."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx")) or f == "fma")


def git_commit(package_dir: Path = Path(__file__).parent.parent) -> str | None:
    """The checkout's commit, with "-dirty" when the package's own files differ from it (the code that ran
    is not that commit's). Only the package counts: results files written into a checkout do not change
    what ran."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=package_dir).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return (commit + "-dirty" if git("status", "--porcelain", "--", ".") else commit) or None
    except (OSError, subprocess.SubprocessError):
        return None


def _drop_cut_line(path: Path) -> None:
    """Every record is written whole with its newline: text after the last newline is a record a killed
    run was cut off writing, not a result. Remove it so that the next record starts a line."""
    if not path.is_file():
        return
    with path.open("r+b") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        f.truncate(f.read().rfind(b"\n") + 1)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record and make sure it is on disk before the next configuration starts."""
    _drop_cut_line(path)
    append_line(path, json.dumps(record), sync=True)


def check_results_file(out: Path) -> None:
    """Refuse a results path that cannot be appended to before measuring, not after the first
    configuration's minutes."""
    if out.is_dir():
        raise LadderError(f"--out {out} is a folder; name a file in it, e.g. {out / 'bench.jsonl'}")
    check_creatable(out)
    existed = out.exists()
    try:  # opening is the only true test: permission bits say nothing to root, or on /proc
        with out.open("a"):
            pass
    except OSError as exc:
        raise LadderError(f"cannot write results to {out}: {exc.strerror.lower()}") from None
    if not existed:  # the file is made by the first result, so a sweep that measures nothing leaves none
        out.unlink()
    elif out.is_file():  # appending results to another tool's file would spoil both
        try:
            read_bench_records(out)
        except LadderError as exc:
            raise LadderError(f"--out names a file that is not ladder bench results: {exc}; name another file") from None


def check_trace_folder(folder: Path) -> None:
    """Make `--profile`'s folder before measuring, or say in one line why it cannot be one."""
    if folder.exists() and not folder.is_dir():
        raise LadderError(f"--profile {folder} is a file; name a folder for the traces")
    check_creatable(folder / "trace.json.gz")


def point_key(description: dict[str, Any], round_: int) -> str:
    """What identifies a measurement: the point's every setting (as `describe()` gives it) and its round."""
    return json.dumps([settings(description), round_], sort_keys=True)


def settings(description: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A point's settings as `describe()` (or a record of it) gives them, but those in `skip`. A setting
    added after a record was written takes its default there."""
    values = {f.name: description.get(f.name, None if f.default is dataclasses.MISSING else f.default)
              for f in dataclasses.fields(BenchPoint) if f.name not in skip}
    if "decode_step" in values:  # (records keep it as three flags)
        values["decode_step"] = DecodeStep.of_record(description).value
    return values


def measured_already(out: Path) -> dict[str, dict[str, Any]]:
    """The successful records of a results file, by `point_key` (a later record of a key wins)."""
    if not out.is_file():
        return {}
    return {point_key(r, r.get("round", 0)): r for r in read_bench_records(out) if r["status"] == "ok"}
