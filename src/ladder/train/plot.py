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


def plot_quality_against_speed(series: dict[str, list[dict]], out: Path) -> Path:
    """Which N to pick: each converted model's perplexity relative to the original's (y, lower is better)
    against the speedup predicted for it (x, higher is better), one panel per interconnect; each series (a
    recipe) in its colour, its Pareto front (no other point of it is both faster and better) joined by a
    line. A point: {"label", "perplexity_ratio", "speedups": {link: speedup}}."""
    plt = pyplot()
    links = list(next(iter(series.values()))[0]["speedups"])
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4.2), sharey=True, squeeze=False)
    for ax, link in zip(axes[0], links):
        for (name, points), colour in zip(series.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            xy = sorted((p["speedups"][link], p["perplexity_ratio"], p["label"]) for p in points)
            ax.scatter([x for x, _, _ in xy], [y for _, y, _ in xy], color=colour)
            for x, y, label in xy:
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            front = [(x, y) for x, y, _ in xy if not any(x2 >= x and y2 < y for x2, y2, _ in xy)]
            ax.plot(*zip(*front), color=colour, alpha=0.5, label=name)
        ax.set(title=link, xlabel="predicted speedup over standard", ylabel="perplexity / original's")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    check_creatable(out)
    return save(fig, out, plt)
