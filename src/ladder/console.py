"""Lines for the user: stderr in one write, stdout on global rank 0 only. No torch here: `ladder --help`
and a mistyped command answer without importing it (2 s of a start on a 2-core machine)."""

import os
import sys


def say(line: str) -> None:
    """One line on stderr in one write. Under torchrun every rank may say the same line at once into
    one pipe; print's two writes (the text, then the newline) interleave them into a garbled line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def is_rank0() -> bool:
    """Whether this process is global rank 0 (every process is when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0")) == 0


def print_rank0(*args: object, **kwargs: object) -> None:
    """print() on global rank 0 only (every process when not distributed)."""
    if is_rank0():
        print(*args, **kwargs)  # type: ignore[call-overload]
        sys.stdout.flush()
