"""Ladder against standard under a stream of requests, on this CPU.

llama-160m (random weights) at TP 4 on the emulated pcie-no-p2p link, dilated as the main job dilates
it at batch 4 (x7.69: communication a quarter of standard's batch-4 decode step, `results/cpu/bench.jsonl`;
a loaded server runs 1 to 8 requests a step, and at batch 1 the main job's x4.87 leaves the link a
twentieth of the step once the load rises), served by `ladder serve` with up to 8 requests in flight; `ladder bench serve` sends 32 requests at
three rates, the last all at once (saturation). Standard, ladder and upper bound in turns, `--rounds`
times. Then the server path's own speed: SmolLM2-135M-Instruct at batch 1, the server's decode tokens/s
(one request at a time; eager, and with --compile-layers) against `ladder generate`'s.

    .venv/bin/python experiments/serving.py [--rounds 3] [--rates 0.5,1.5,inf] [--only load|speed|summary]

Writes results/serve/{bench-serve.jsonl,speed.jsonl,summary.md,latency.png}.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from ladder.cli.bench_serve import plot_latency_vs_load

OUT = Path("results/serve")
LAYOUTS = ("standard", "ladder", "upper-bound")


def ladder(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "ladder", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"ladder {' '.join(args)} failed: {result.stderr[-2000:]}")
    print(result.stderr, flush=True)
    return result


def under_load(args: argparse.Namespace) -> None:
    for round_ in range(args.rounds):
        for layout in LAYOUTS:
            serve = (f"--preset llama-160m --layout {layout} --tp 4 --interconnect pcie-no-p2p "
                     f"--link-scale {args.link_scale} --max-batch 8 --max-model-len 512")
            ladder("bench", "serve", "--serve", serve, "--label", layout, "--request-rates", args.rates,
                   "--num-requests", str(args.num_requests), "--byte-prompts", "--prompt-len", "128",
                   "--output-len", "64", "--seed", str(round_), "--out", str(OUT / "bench-serve.jsonl"))


SPEED_VARIANTS = {"server": "--eager", "server_compiled_layers": "--compile-layers --max-model-len 256"}


def batch_one_speed(args: argparse.Namespace) -> None:
    """The server's decode tokens/s at batch 1 (eager, and with its decode step's layers compiled) against
    ladder generate's, on the same model and prompt."""
    records = []
    for round_ in range(args.rounds):
        generated = ladder("generate", "--model", "smollm2-135m-instruct", "--prompt-ids", "72,101,108,108",
                           "--max-new-tokens", "128")  # ids: no end-of-sequence stop, as the server's ignore_eos
        record = {"round": round_, "generate_decode_tokens_per_s":
                  float(re.search(r"decode ([\d.]+) tokens/s", generated.stderr).group(1))}
        for name, extra in SPEED_VARIANTS.items():
            out = OUT / "speed-run.jsonl"
            out.unlink(missing_ok=True)
            ladder("bench", "serve", "--serve", f"--model smollm2-135m-instruct --max-batch 1 {extra}", "--dataset",
                   "fixed", "--byte-prompts", "--prompt-len", "4", "--output-len", "128", "--num-requests", "4",
                   "--max-concurrency", "1", "--out", str(out))
            record[f"{name}_decode_tokens_per_s"] = 1000 / json.loads(out.read_text().splitlines()[-1])["itl_ms"]["mean"]
            out.unlink()
        records.append(record)
    (OUT / "speed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def summary() -> None:
    rows = [json.loads(line) for line in (OUT / "bench-serve.jsonl").read_text().splitlines()]
    by = {}
    for r in rows:
        by.setdefault((r["label"], r["request_rate"]), []).append(r)
    rates = sorted({r["request_rate"] for r in rows})
    lines = ["| rate (req/s) | layout | served req/s | output tok/s | ITL mean (ms) | ITL p99 | TTFT p50 (ms) "
             "| E2E p50 (ms) | hidden (ITL) |", "|---|---|---|---|---|---|---|---|---|"]
    med = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731 (the median over rounds)
    for rate in rates:
        itl = {layout: med(by[(layout, rate)], lambda r: r["itl_ms"]["mean"]) for layout in LAYOUTS}
        for layout in LAYOUTS:
            rs = by[(layout, rate)]
            hidden = ""
            if layout == "ladder" and itl["standard"] > itl["upper-bound"]:
                hidden = f"{(itl['standard'] - itl['ladder']) / (itl['standard'] - itl['upper-bound']):.2f}"
            lines.append(f"| {rate:g} | {layout} | {med(rs, lambda r: r['request_throughput']):.2f} | "
                         f"{med(rs, lambda r: r['output_throughput']):.1f} | {itl[layout]:.1f} | "
                         f"{med(rs, lambda r: r['itl_ms']['p99']):.1f} | {med(rs, lambda r: r['ttft_ms']['p50']):.0f} | "
                         f"{med(rs, lambda r: r['e2e_ms']['p50']):.0f} | {hidden} |")
    speed = [json.loads(line) for line in (OUT / "speed.jsonl").read_text().splitlines()]
    g = statistics.median(r["generate_decode_tokens_per_s"] for r in speed)
    s = statistics.median(r["server_decode_tokens_per_s"] for r in speed)
    lines += ["", f"Batch 1, SmolLM2-135M-Instruct, TP 1: ladder generate decodes {g:.1f} tokens/s, the server "
              f"{s:.1f} ({s / g - 1:+.1%}; median of {len(speed)} rounds)."]
    if "server_compiled_layers_decode_tokens_per_s" in speed[0]:
        c = statistics.median(r["server_compiled_layers_decode_tokens_per_s"] for r in speed)
        lines[-1] += f" With --compile-layers the server decodes {c:.1f} ({c / g - 1:+.1%})."
    lines += ["", "ITL p99 in bench-serve.jsonl: the nearest rank (the percentile code of the run's commit; "
              "ladder now interpolates between ranks, `ladder.bench.summary.percentiles`)."]
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rates", default="0.5,1.5,inf")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--link-scale", default="7.69")
    parser.add_argument("--only", choices=["load", "speed", "summary"], help="one part (default: all)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "load"):
        (OUT / "bench-serve.jsonl").unlink(missing_ok=True)
        under_load(args)
    if args.only in (None, "speed"):
        batch_one_speed(args)
    summary()
    rows = [json.loads(line) for line in (OUT / "bench-serve.jsonl").read_text().splitlines()]
    plot_latency_vs_load(rows, OUT / "latency.png")


if __name__ == "__main__":
    main()
