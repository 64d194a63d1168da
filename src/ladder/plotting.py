"""What every picture shares: matplotlib (loaded only when drawing), log axes labelled plainly, and an
atomic save. Pictures are drawn from results files, never from numbers typed into a script."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ladder.errors import LadderError
from ladder.files import atomic_write


def pyplot() -> Any:
    """matplotlib.pyplot, drawing to files. Imported when a picture is drawn: matplotlib takes about a
    second to import, which no other command should pay."""
    try:
        import matplotlib
    except ImportError:
        raise LadderError("plotting needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plain_log_labels(axis) -> None:
    """Label a log axis 20, 30, 40 rather than 2x10^1, 3x10^1, 4x10^1 (the same ticks labelled)."""
    from matplotlib.ticker import LogFormatterSciNotation  # (loaded only when drawing, as in `pyplot`)

    class Plain(LogFormatterSciNotation):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    axis.set_major_formatter(Plain(labelOnlyBase=False))
    axis.set_minor_formatter(Plain(labelOnlyBase=False))


def save(fig, path: Path, plt) -> Path:
    """Written whole or not at all (`ladder.files.atomic_write`): a reader never sees half a picture."""
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)
