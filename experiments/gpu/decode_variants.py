"""Variants of one decode step side by side, as markdown: one `ladder bench` results file per variant (its
name the variant's), each measured alone with a setting of its own (an attention kernel, inductor options,
an earlier checkout's package), and each against the first file given (the reference).

Usage: python experiments/gpu/decode_variants.py REFERENCE.jsonl OTHER.jsonl ... [--copy-tbps 3.03]
(scripts/gpu_checks.sh, step `variants`; --copy-tbps: the device-to-device copy bandwidth of
environment.txt, the roofline each step's bytes are read against.)"""

import argparse
import statistics
from pathlib import Path

from ladder.bench.summary import read_bench_records


def measured(path: Path) -> list[dict]:
    return [r for r in read_bench_records(path) if r.get("status") == "ok"]


def row(name: str, record: dict, reference: dict | None, copy_tbps: float | None) -> str:
    step_ms = record["decode_token_latency_ms"]["p50"]
    tbps = record["achieved_bandwidth_gbps"] / 1e3
    settings = ", ".join(f"{k}={v}" for k, v in sorted(record["env"].get("settings", {}).items())) or "defaults"
    versus = f"{record['tokens_per_s'] / reference['tokens_per_s']:.3f}" if reference else ""
    share = f"{tbps / copy_tbps:.2f}" if copy_tbps else ""
    return (f"| {name} | {record['batch_size']} | {record['tokens_per_s']:.1f} | {step_ms:.2f} | {tbps:.3g} | {share} "
            f"| {versus} | {record['env'].get('git_commit')} | {settings} |")


def table(paths: list[Path], copy_tbps: float | None) -> str:
    lines = ["| variant | batch | tokens/s | step p50 (ms) | weights + KV read (TB/s) | share of copy | vs first "
             "| package | settings |", "|---|---|---|---|---|---|---|---|---|"]
    reference = {r["batch_size"]: r for r in measured(paths[0])} if paths else {}
    for path in paths:
        for record in sorted(measured(path), key=lambda r: r["batch_size"]):
            lines.append(row(path.stem, record, reference.get(record["batch_size"]), copy_tbps))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="one results file per variant, the reference first")
    parser.add_argument("--copy-tbps", type=float, help="the device-to-device copy bandwidth (read plus written)")
    args = parser.parse_args()
    print(table(args.results, args.copy_tbps))
    runs = [r for path in args.results for r in measured(path)]
    if runs:
        spread = [max(r["tokens_per_s_runs"]) / min(r["tokens_per_s_runs"]) - 1 for r in runs]
        print(f"\nRun-to-run spread within a variant: median {statistics.median(spread):.1%}, "
              f"largest {max(spread):.1%} (a difference between variants smaller than that is noise).")


if __name__ == "__main__":
    main()
