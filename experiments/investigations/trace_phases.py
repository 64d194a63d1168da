"""A GPU trace of `ladder bench --profile`, split into its prefill and its decode steps.

For each phase: how long each emulated all-reduce (sleep kernel) lasted and the share of it during which
compute kernels ran; for the decode steps also the share of their wall time with a compute kernel
running, and kernels per step. What falls outside both is the gaps between kernels.

    python experiments/investigations/trace_phases.py results/gpu/traces/*.json.gz
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ladder.bench.trace import intervals, link_overlap, read_trace, union

LINK_KERNEL = "spin_kernel"


def phases(path: Path) -> str:
    kernels = sorted((e for e in read_trace(path) if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    link = [e for e in kernels if LINK_KERNEL in e.get("name", "")]
    compute = [e for e in kernels if LINK_KERNEL not in e.get("name", "")]
    if not link:
        return f"{path.name}: no emulated all-reduce"
    # The prefill runs the model once; every decode step sends as many all-reduces as the prefill did.
    per_pass = _passes(link)
    lines = [path.name]
    for name, part in (("prefill", link[:per_pass]), ("decode", link[per_pass:])):
        if part:
            overlap = link_overlap(compute + part)
            lines.append(f"  {name}: {len(part)} all-reduces of {overlap['link_s'] * 1e6 / len(part):.1f} us each, "
                         f"compute during {overlap['overlap_fraction']:.2f} of them")
    decode = link[per_pass:]
    if decode:
        start, end = float(decode[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in kernels)
        running = sum(min(b, end) - max(a, start) for a, b in union(intervals(compute)) if b > start)
        steps = len(decode) / per_pass
        n = sum(1 for e in compute if float(e["ts"]) >= start)
        lines.append(f"  decode: {steps:.0f} steps in {(end - start) / 1e3:.1f} ms, a compute kernel running "
                     f"{running / (end - start):.2f} of the time, {n / steps:.0f} kernels a step")
    return "\n".join(lines)


def _passes(link: list[dict]) -> int:
    """All-reduces of one forward pass: the prefill's, whose messages are the prompt's length times
    larger than a decode step's (the first all-reduce as long as the prefill's first)."""
    first = float(link[0]["dur"])
    return next((i for i, e in enumerate(link) if float(e["dur"]) < first / 2), len(link))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    for path in parser.parse_args().traces:
        print(phases(path))


if __name__ == "__main__":
    main()
