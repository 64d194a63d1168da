"""`ladder train plot`: loss curves of training runs, from their metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from ladder.bench.summary import json_lines
from ladder.errors import LadderError, check_creatable
from ladder.plotting import plain_log_labels, pyplot, save


def plot_training(runs: list[Path], out: Path) -> Path:
    """Training (and held-out) loss against tokens for one or more runs, on one picture."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        metrics = run / "metrics.jsonl"
        if not metrics.is_file():
            raise LadderError(f"{run} has no metrics.jsonl (not a training run folder?)")
        rows = []
        for n, row in json_lines(metrics):
            if not (isinstance(row, dict) and "tokens" in row and "loss" in row):
                raise LadderError(f"{metrics}:{n} is not a ladder train record (it has no tokens and loss)")
            rows.append(row)
        line, = ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], alpha=0.7, label=f"{run.name} train")
        held = [(r["tokens"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        if held:
            ax.plot(*zip(*held), marker="o", linestyle="--", color=line.get_color(), label=f"{run.name} held-out")
    ax.set(xlabel="training tokens", ylabel="loss (nats/token)", yscale="log")
    plain_log_labels(ax.yaxis)
    ax.legend(fontsize=7)
    fig.tight_layout()
    check_creatable(out)
    return save(fig, out, plt)
