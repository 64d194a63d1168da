"""Where a CUDA-graph decode step's time goes, from a `ladder bench --profile` trace: per graph replay (one
decode step), its kernels, its GPU span, the time in kernels by kind (GEMMs are the weight reads), the gaps
between kernels inside the graph, and how long after the replay's launch call its first kernel started.

    python experiments/investigations/decode_step_kernels.py results/gpu/h200/traces/*.json.gz

(results/gpu/h200/report.md's table "Where the rest of the step goes" is this script's output on the 8B
batch-1 trace and the 70B upper bound's batch-1 trace.)
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from ladder.bench.trace import read_trace

KINDS = (("spin", "emulated link"), ("gemv", "GEMM"), ("gemm", "GEMM"), ("nvjet", "GEMM"), ("cutlass", "GEMM"),
         ("splitkreduce", "split-K reduction"), ("flash", "attention"), ("sdpa", "attention"),
         ("lean_reduction", "attention"), ("triton", "Triton (compiled)"), ("reduce_kernel", "reduction (eager)"),
         ("elementwise", "elementwise (eager)"))


def kind(name: str) -> str:
    lowered = name.lower()
    return next((label for key, label in KINDS if key in lowered), "other")


def steps(path: Path) -> str:
    events = read_trace(path)
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")),
                      key=lambda e: float(e["ts"]))
    if not launches:
        return f"{path.name}: no CUDA graph replay"
    by_launch: dict[int, list[dict]] = {e["args"]["correlation"]: [] for e in launches}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["args"].get("correlation") in by_launch:
            by_launch[e["args"]["correlation"]].append(e)
    lines = [f"{path.parent.name}/{path.name}"]
    for i, launch in enumerate(launches):
        kernels = sorted(by_launch[launch["args"]["correlation"]], key=lambda e: float(e["ts"]))
        start, end = float(kernels[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in kernels)
        busy = sum(float(e["dur"]) for e in kernels)
        lines.append(f"  step {i}: {len(kernels)} kernels, span {(end - start) / 1e3:.3f} ms, in kernels "
                     f"{busy / 1e3:.3f} ms, gaps {(end - start - busy) / 1e3:.3f} ms; first kernel "
                     f"{start - float(launch['ts']):.0f} us after the launch call")
        if i == 0:
            time, count = Counter(), Counter()
            for e in kernels:
                time[kind(e["name"])] += float(e["dur"])
                count[kind(e["name"])] += 1
            lines += [f"    {label:22s} {us / 1e3:7.3f} ms  {count[label]:5d} kernels" for label, us in time.most_common()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    for path in parser.parse_args().traces:
        print(steps(path))


if __name__ == "__main__":
    main()
