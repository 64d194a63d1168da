"""Pictures drawn from results files (never from numbers typed into a script)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ladder.bench import layout_label, link_label, summarise
from ladder.errors import LadderError

COLORS = {"standard": "tab:gray", "parallel": "tab:blue", "ladder": "tab:red", "desync": "tab:purple",
          "upper-bound": "tab:green"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise LadderError("plotting needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _panel(r: dict[str, Any]) -> tuple[str, str]:
    """Results drawn together: one model on one link (at one dilation)."""
    return r["preset"], link_label(r)


def _panel_title(preset: str, link: str) -> str:
    return f"{preset}, {link}"


def plot_bench(records: list[dict[str, Any]], out_dir: Path | None = None, results_path: Path | None = None
               ) -> list[Path]:
    """Three PNGs: tokens/s vs batch, speedup over standard vs batch, latency-vs-throughput Pareto."""
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        raise LadderError("the results file holds no successful measurement to plot")
    out_dir = out_dir or (results_path.parent if results_path else Path("."))
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    panels = sorted({_panel(r) for r in ok})
    paths = []

    # 1. tokens/s vs batch, one line per (layout, tp)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        series: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
        for r in ok:
            if _panel(r) == panel:
                series[(layout_label(r), r["tp"])].append((r["batch_size"], r["tokens_per_s"]))
        for (label, tp), pts in sorted(series.items()):
            pts.sort()
            ax.plot(*zip(*pts), marker="o", color=COLORS.get(label.split("[")[0]),
                    linestyle=["-", "--", ":", "-."][sorted({k[1] for k in series}).index(tp) % 4],
                    label=f"{label} tp={tp}")
        ax.set(yscale="log", xlabel="batch size", ylabel="tokens/s", title=_panel_title(*panel))
        _batch_axis(ax, [b for pts in series.values() for b, _ in pts])
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "throughput.png", plt))

    # 2. speedup over standard vs batch
    rows = [r for r in summarise(ok) if r["speedup"] is not None and r["layout"] != "standard"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        series = defaultdict(list)
        for r in rows:
            if (r["preset"], r["link"]) == panel:
                series[(r["layout"], r["tp"])].append((r["batch_size"], r["speedup"]))
        for (label, tp), pts in sorted(series.items()):
            pts.sort()
            ax.plot(*zip(*pts), marker="o", color=COLORS.get(label.split("[")[0]), label=f"{label} tp={tp}",
                    linestyle=["-", "--", ":", "-."][sorted({k[1] for k in series}).index(tp) % 4])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(xlabel="batch size", ylabel="speedup over standard", title=_panel_title(*panel))
        _batch_axis(ax, [b for pts in series.values() for b, _ in pts])
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "speedup.png", plt))

    # 3. Pareto: decode latency per token vs tokens/s per device, across TP and batch
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        by_layout = defaultdict(list)
        for r in ok:
            if _panel(r) == panel and r.get("decode_token_latency_ms"):
                by_layout[layout_label(r)].append((r["decode_token_latency_ms"]["p50"],
                                                   r["tokens_per_s_per_device"], r["tp"], r["batch_size"]))
        for label, pts in sorted(by_layout.items()):
            color = COLORS.get(label.split("[")[0])
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, s=18, alpha=0.6)
            front = pareto_frontier([(p[0], p[1]) for p in pts])
            ax.plot(*zip(*front), color=color, label=label)
        ax.set(xscale="log", yscale="log", xlabel="decode latency per token, p50 (ms)",
               ylabel="tokens/s per device", title=_panel_title(*panel) + ": Pareto over TP x batch")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "pareto.png", plt))
    return paths


def _batch_axis(ax, batch_sizes: list[int]) -> None:
    """A base-2 axis labelled with the batch sizes themselves."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ticks = sorted(set(batch_sizes))
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())


def pareto_frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten by any other (lower latency and higher throughput), by latency."""
    front: list[tuple[float, float]] = []
    for latency, throughput in sorted(points):
        if not front or throughput > front[-1][1]:
            front.append((latency, throughput))
    return front


def _save(fig, path: Path, plt) -> Path:
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)  # atomic: a reader never sees half a picture
    return path


def plot_training(runs: list[Path], out: Path) -> Path:
    """Training (and held-out) loss against tokens for one or more runs, on one picture."""
    import json

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        metrics = run / "metrics.jsonl"
        if not metrics.is_file():
            raise LadderError(f"{run} has no metrics.jsonl (not a training run folder?)")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        line, = ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], alpha=0.7, label=f"{run.name} train")
        held = [(r["tokens"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        if held:
            ax.plot(*zip(*held), marker="o", linestyle="--", color=line.get_color(), label=f"{run.name} held-out")
    ax.set(xlabel="training tokens", ylabel="loss (nats/token)", yscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out, plt)
