"""Files written so that a failure is one line and loses nothing, and checkpoints read so that damage is
one line.

Every command that writes (train's checkpoints and metrics, convert, bench's results and pictures, eval's
output, the teacher's answers) writes through `writing(path)`: the write goes to a temporary sibling that
is renamed into place when whole (or, for an appended line, the file is cut back to its old end), and an
error of the file system becomes one line that names the path and the cause (no space, no permission, a
read-only file system, a file-size limit) with, where known, the space needed and the space free. The
older outputs stay as they were. An error that is not the file system's passes unchanged: it is a bug.

torch and safetensors wrap the operating system's error in their own (torch's zip writer says only
"unexpected pos 586624 vs 586516"): the cause is read from the text where it is there, and from the
state of the disk (free space, the process's file-size limit) where it is not.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from ladder.errors import LadderError

CAUSES = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up",
          errno.EACCES: "no permission", errno.EPERM: "no permission", errno.EROFS: "a read-only file system",
          errno.EFBIG: "the file would pass the file-size limit (ulimit -f)"}
# What torch's and safetensors' wrappers say for those errors: "os error 28", "No space left on device", ...
_SAID = [(re.compile(r"os error (\d+)"), None),
         (re.compile(r"No space left|StorageFull", re.I), errno.ENOSPC),
         (re.compile(r"Disk quota exceeded|QuotaExceeded", re.I), errno.EDQUOT),
         (re.compile(r"Permission denied|PermissionDenied", re.I), errno.EACCES),
         (re.compile(r"Read-only file system|ReadOnlyFilesystem", re.I), errno.EROFS),
         (re.compile(r"File too large|FileTooLarge", re.I), errno.EFBIG)]
# torch's zip writer when a write came back short (the error number is lost)
_SHORT_WRITE = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed", re.I)


def human(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def free_bytes(path: Path) -> int | None:
    """Free space on the file system that holds `path` (or its nearest existing folder)."""
    folder = next((p for p in [path, *path.parents] if p.exists()), None)
    try:
        return shutil.disk_usage(folder).free if folder is not None else None
    except OSError:
        return None


def write_cause(exc: BaseException, path: Path) -> str | None:
    """Why a write to `path` failed, in a few words; None when `exc` is not the file system's error."""
    for link in _chain(exc):
        if isinstance(link, OSError) and link.errno in CAUSES:
            return CAUSES[link.errno]
        text = str(link)
        for pattern, number in _SAID:
            found = pattern.search(text)
            if found:
                number = number if number is not None else int(found.group(1))
                if number in CAUSES:
                    return CAUSES[number]
        if _SHORT_WRITE.search(text):
            return _short_write_cause(path)
    return None


def _short_write_cause(path: Path) -> str:
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"the file would pass the file-size limit of {human(limit)} (ulimit -f)"
    free = free_bytes(path)
    if free is not None and free < 1 << 20:
        return CAUSES[errno.ENOSPC]
    return "the write was cut short"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


@contextlib.contextmanager
def writing(path: Path, needed: int | None = None) -> Iterator[None]:
    """Turn a file-system error inside into one line about `path` (`needed`: the bytes the write takes)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 (only the file system's errors are translated; the rest re-raised)
        cause = write_cause(exc, path)
        if cause is None:
            raise
        raise LadderError(failed_write(path, cause, needed)) from None


def failed_write(path: Path, cause: str, needed: int | None = None) -> str:
    free = free_bytes(path)
    room = "" if cause != CAUSES[errno.ENOSPC] or free is None else (
        f" ({human(needed)} needed, {human(free)} free)" if needed else f" ({human(free)} free)")
    return f"cannot write {path}: {cause}{room}; nothing was changed there"


def atomic_write(path: Path, write: Callable[[Path], None], needed: int | None = None) -> Path:
    """`write(tmp)` into a temporary sibling of `path`, renamed over `path` once whole; on any failure the
    sibling is removed and `path` is as it was (a file-system error: one line, `writing`)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path, needed):
        try:
            write(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


def write_text(path: Path, text: str) -> Path:
    """A text file written whole or not at all."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), len(text.encode()))


def append_line(path: Path, line: str, sync: bool = False) -> None:
    """One line appended whole, or the file cut back to where it ended (a line half-written on a full disk
    would spoil the file for its readers)."""
    data = (line if line.endswith("\n") else line + "\n").encode()
    with writing(path, len(data)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):  # a short write (the limit reached mid-line) fails on the next call
                written += os.write(fd, data[written:])
            if sync:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise
        finally:
            os.close(fd)


def check_room(folder: Path, needed: int, what: str) -> None:
    """Refuse, in one line and before it starts, a write of `needed` bytes into `folder` that the disk
    cannot hold."""
    free = free_bytes(folder)
    if free is not None and free < needed:
        raise LadderError(f"not enough space in {folder} for {what}: it needs about {human(needed)}, "
                          f"{human(free)} are free; free some space (older outputs are kept as they are)")


def safetensors_damage(path: Path) -> str | None:
    """"is missing" or "is cut short" for a safetensors file whose header or tensors are not all there."""
    try:
        with path.open("rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_size))
            size = f.seek(0, os.SEEK_END)
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError, UnicodeDecodeError):
        return "is cut short"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    return "is cut short" if size < 8 + header_size + max(ends, default=0) else None


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
