"""Pictures drawn from results files (never from numbers typed into a script)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladder.bench.summary import (decode_step, device_name, layout_label, layout_order, link_label,
                                  pooled_tokens_per_s)
from ladder.errors import LadderError, check_creatable
from ladder.plotting import plain_log_labels, pyplot, save

COLORS = {"standard": "tab:gray", "parallel": "tab:blue", "ladder": "tab:red", "desync": "tab:purple",
          "upper-bound": "tab:green"}


Panel = tuple  # (preset, link label, prompt_len, gen_len, device name, dtype, decode step): results drawn together


def _panel(r: dict[str, Any]) -> Panel:
    return (r["preset"], link_label(r), r["prompt_len"], r["gen_len"], device_name(r) or "?", r.get("dtype") or "?",
            decode_step(r))


TITLE_LINE_CHARS = 48  # what a 5.5-inch panel holds at the title's font size


def _panel_title(panel: Panel) -> str:
    preset, link, prompt_len, gen_len, device, dtype, step = panel
    model_and_link = f"{preset}, {link}" if len(f"{preset}, {link}") <= TITLE_LINE_CHARS else f"{preset}\n{link}"
    return (f"{model_and_link}\nprompt {prompt_len}, {gen_len} new tokens\n{device}, {dtype}"
            f"{'' if step == 'eager' else ', ' + step}")


@dataclass
class _Point:
    """One layout of one configuration, all its records (rounds, sweeps run again) pooled as `summarise`
    pools them."""
    layout: str
    tp: int
    batch_size: int
    tokens_per_s: float  # median over every measured run of every record
    latency_ms: float | None  # median of the records' median decode latency per token
    ladder_depth: int | None  # layers on ladder: a hybrid's N, all of them for whole ladder, None for the others
    records: list[tuple[float, float | None]]  # each record's own (tokens/s, latency): drawn faint


def _pooled_points(ok: list[dict[str, Any]]) -> dict[Panel, list[_Point]]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        groups[(_panel(r), layout_label(r), r["tp"], r["batch_size"])].append(r)
    panels: dict[Panel, list[_Point]] = defaultdict(list)
    for (panel, layout, tp, batch), rs in sorted(groups.items()):
        latencies = [(r.get("decode_token_latency_ms") or {}).get("p50") for r in rs]
        known = [x for x in latencies if x is not None]
        panels[panel].append(_Point(
            layout, tp, batch,
            tokens_per_s=pooled_tokens_per_s(rs),
            latency_ms=statistics.median(known) if known else None,
            ladder_depth=_ladder_depth(rs[0]),
            records=[(r["tokens_per_s"], latency) for r, latency in zip(rs, latencies)]))
    return dict(sorted(panels.items()))


def _ladder_depth(r: dict[str, Any]) -> int | None:
    if r["layout"] != "ladder":
        return None
    return r["ladder_layers"] if r.get("ladder_layers") is not None else r.get("model", {}).get("n_layers")


HYBRID_COLORS = ["tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]


def _palette(points: list[_Point]) -> dict[str, str | None]:
    """A colour per layout of a panel: each its own, and hybrids (`ladder[N]`, by N) their own beside ladder's."""
    layouts = {p.layout for p in points}
    hybrids = sorted((layout for layout in layouts if layout.startswith("ladder[")),
                     key=lambda layout: int(layout[len("ladder["):-1]))
    colors: dict[str, str | None] = {layout: COLORS.get(layout) for layout in layouts}
    colors.update({layout: HYBRID_COLORS[i % len(HYBRID_COLORS)] for i, layout in enumerate(hybrids)})
    return colors


def plot_bench(records: list[dict[str, Any]], out_dir: Path | None = None, results_path: Path | None = None
               ) -> tuple[list[Path], list[str]]:
    """Three PNGs: tokens/s vs batch, speedup over standard vs batch, latency-vs-throughput Pareto; and a
    line for each that was not drawn (the speedup needs standard and another layout at equal TP and batch).
    With hybrids of two depths or more (`--ladder-layers 3,6,9`), a fourth: speedup vs ladder layers.
    Lines join pooled values; faint dots are the records pooled (rounds of `--rounds`, sweeps run again).
    One panel per model shape, interconnect, lengths, device and decode step (`Panel`)."""
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        raise LadderError("the results hold no successful measurement to plot")
    out_dir = out_dir or (results_path.parent if results_path else Path("."))
    check_creatable(out_dir / "throughput.png")
    plt = pyplot()
    panels = _pooled_points(ok)
    pictures = [("throughput.png", _draw_throughput), ("speedup.png", _draw_speedup), ("pareto.png", _draw_pareto)]
    not_drawn = []
    if not any(_speedups(points) for points in panels.values()):
        pictures.pop(1)
        not_drawn.append("speedup.png not drawn: no layout was measured beside standard at the same TP and batch")
    paths = [_draw_panels(plt, panels, draw, out_dir / name) for name, draw in pictures]
    with_hybrids = {panel: points for panel, points in panels.items() if len(_by_depth(points)) > 1}
    if with_hybrids:
        paths.append(_draw_panels(plt, with_hybrids, _draw_hybrids, out_dir / "hybrid.png"))
    return paths, not_drawn


def _draw_panels(plt: Any, panels: dict[Panel, list[_Point]], draw: Any, path: Path) -> Path:
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    for ax, (panel, points) in zip(axes[0], panels.items()):
        draw(ax, panel, points)
        if ax.get_legend_handles_labels()[0]:  # a panel can have nothing to draw (no latencies recorded)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, path, plt)


def _line_style(points: list[_Point], tp: int) -> str:
    """One dash pattern per TP degree of the panel."""
    return ["-", "--", ":", "-."][sorted({p.tp for p in points}).index(tp) % 4]


def _draw_throughput(ax: Any, panel: Panel, points: list[_Point]) -> None:
    """tokens/s vs batch, one line per (layout, tp)."""
    color = _palette(points)
    for (layout, tp), series in _by_layout_and_tp(points).items():
        ax.plot([p.batch_size for p in series], [p.tokens_per_s for p in series], marker="o", color=color[layout],
                linestyle=_line_style(points, tp), label=f"{layout} tp={tp}")
        ax.scatter([p.batch_size for p in series for _ in p.records],
                   [tps for p in series for tps, _ in p.records], color=color[layout], s=10, alpha=0.3)
    ax.set(yscale="log", xlabel="batch size", ylabel="tokens/s", title=_panel_title(panel))
    plain_log_labels(ax.yaxis)
    _batch_axis(ax, [p.batch_size for p in points])


def _speedups(points: list[_Point]) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """(batch, speedup over standard at equal TP and batch) by (layout, tp), for every layout but standard."""
    standard = {(p.tp, p.batch_size): p.tokens_per_s for p in points if p.layout == "standard"}
    speedups = {}
    for (layout, tp), series in _by_layout_and_tp(points).items():
        pairs = [(p.batch_size, p.tokens_per_s / standard[(tp, p.batch_size)]) for p in series
                 if (tp, p.batch_size) in standard]
        if layout != "standard" and pairs:
            speedups[(layout, tp)] = pairs
    return speedups


def _draw_speedup(ax: Any, panel: Panel, points: list[_Point]) -> None:
    """Speedup over standard vs batch, at equal TP and batch."""
    color = _palette(points)
    for (layout, tp), pairs in _speedups(points).items():
        ax.plot(*zip(*pairs), marker="o", color=color[layout], linestyle=_line_style(points, tp),
                label=f"{layout} tp={tp}")
    ax.axhline(1.0, color="black", linewidth=0.8, label="standard")
    ax.set(xlabel="batch size", ylabel="speedup over standard", title=_panel_title(panel))
    _batch_axis(ax, [p.batch_size for p in points])


def _by_depth(points: list[_Point]) -> dict[int, list[_Point]]:
    """The ladder layouts of a panel by their number of ladder layers (a hybrid's N; whole ladder: all)."""
    depths: dict[int, list[_Point]] = defaultdict(list)
    for p in points:
        if p.ladder_depth is not None:
            depths[p.ladder_depth].append(p)
    return dict(sorted(depths.items()))


def _draw_hybrids(ax: Any, panel: Panel, points: list[_Point]) -> None:
    """Speedup over standard vs the number of layers on ladder (standard: none), a line per TP and batch,
    and the upper bound each could reach as a dotted line in its colour."""
    standard = {(p.tp, p.batch_size): p.tokens_per_s for p in points if p.layout == "standard"}
    upper_bound = {(p.tp, p.batch_size): p.tokens_per_s for p in points if p.layout == "upper-bound"}
    configurations = sorted({(p.tp, p.batch_size) for depth in _by_depth(points).values() for p in depth
                             if (p.tp, p.batch_size) in standard})
    for i, (tp, batch) in enumerate(configurations):
        pairs = [(0, 1.0)] + [(p.ladder_depth, p.tokens_per_s / standard[(tp, batch)]) for p in
                              sorted(points, key=lambda p: p.ladder_depth or 0)
                              if p.ladder_depth and (p.tp, p.batch_size) == (tp, batch)]
        line, = ax.plot(*zip(*pairs), marker="o", label=f"tp={tp} batch {batch}", color=f"C{i}")
        if (tp, batch) in upper_bound:
            ax.axhline(upper_bound[(tp, batch)] / standard[(tp, batch)], color=line.get_color(), linestyle=":",
                       linewidth=0.9, label=f"upper bound, tp={tp} batch {batch}")
    depths = sorted({0, *_by_depth(points)})
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set(xlabel="layers on ladder (the last N; 0: standard)", ylabel="speedup over standard",
           title=_panel_title(panel))


def _draw_pareto(ax: Any, panel: Panel, points: list[_Point]) -> None:
    """Decode latency per token vs tokens/s per device across TP and batch, each layout's frontier drawn."""
    color = _palette(points)
    for layout in sorted({p.layout for p in points}, key=layout_order):
        mine = [p for p in points if p.layout == layout and p.latency_ms is not None]
        if not mine:
            continue
        xy = [(p.latency_ms, p.tokens_per_s / p.tp) for p in mine]
        ax.scatter(*zip(*xy), color=color[layout], s=22)
        faint = [(latency, tps / p.tp) for p in mine for tps, latency in p.records if latency is not None]
        ax.scatter(*zip(*faint), color=color[layout], s=8, alpha=0.25)
        for p, (x, y) in zip(mine, xy):
            ax.annotate(f"tp{p.tp} b{p.batch_size}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6,
                        color=color[layout])
        ax.plot(*zip(*pareto_frontier(xy)), color=color[layout], label=layout)
    ax.set(xscale="log", yscale="log", xlabel="decode latency per token, p50 (ms)",
           ylabel="tokens/s per device", title=_panel_title(panel) + "\nPareto frontier over TP x batch")
    plain_log_labels(ax.xaxis)
    plain_log_labels(ax.yaxis)


def _by_layout_and_tp(points: list[_Point]) -> dict[tuple[str, int], list[_Point]]:
    series: dict[tuple[str, int], list[_Point]] = defaultdict(list)
    for p in sorted(points, key=lambda p: p.batch_size):
        series[(p.layout, p.tp)].append(p)
    return dict(sorted(series.items(), key=lambda item: (layout_order(item[0][0]), item[0][1])))


def _batch_axis(ax, batch_sizes: list[int]) -> None:
    """A base-2 axis labelled with the batch sizes themselves."""
    from matplotlib.ticker import NullLocator  # (matplotlib is loaded only when drawing: `pyplot`)

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
