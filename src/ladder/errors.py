"""The exceptions users see as one line (errors of their input or environment, stop signals, a rank
that stopped answering), and what that line says. No torch here: `ladder --help` imports this module."""

import re
import signal
import sys
from pathlib import Path


class LadderError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class Stopped(BaseException):
    """A signal other than Ctrl-C (SIGTERM from a scheduler, SIGHUP...) stopped the workers: the whole
    command stops, as with KeyboardInterrupt (a BaseException, so no `except Exception` goes on)."""

    def __init__(self, signum: int, said: str = "") -> None:
        self.signum = signum  # `said`: what the stopped work did about it (saved a checkpoint)
        super().__init__(f"stopped by {signal.Signals(signum).name}" + (f": {said}" if said else ""))


def check_creatable(path: Path) -> None:
    """Make `path`'s folder (before the work whose result goes there, not after it), or say in one
    line why it cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next(p for p in reversed(path.parents) if p.exists() and not p.is_dir())
        raise LadderError(f"cannot write {path}: {blocker} is a file, not a folder") from None
    except OSError as exc:
        raise LadderError(f"cannot write {path}: {exc.strerror}") from None


def stop_message(stop: BaseException) -> str:
    """"interrupted", "interrupted: saved step 40 to ...", "stopped by SIGTERM[: saved step ...]"."""
    if isinstance(stop, Stopped):
        return str(stop)
    return "interrupted" + (f": {stop}" if str(stop) else "")


def exit_status(stop: BaseException) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (Ctrl-C: 130)."""
    return 128 + (stop.signum if isinstance(stop, Stopped) else signal.SIGINT)


def communication_failure(exc: BaseException) -> str | None:
    """One line for torch.distributed's errors when another rank died or stopped answering (gloo's
    transport errors and timeouts, NCCL's), None for any other error. The ranks still alive say it
    in that line, not in a page of traceback; the rank that failed says why on its own node."""
    text = str(exc).strip()
    dist = sys.modules.get("torch.distributed")  # (not imported: no process group, so not its error)
    if not (dist is not None and isinstance(exc, dist.DistError) or "gloo/transport" in text or "NCCL" in text):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(exc).__name__)  # (source location)
    return (f"communication with the other ranks failed ({first.split('. ')[0]}); a rank that died or failed says "
            "why on its own node")
