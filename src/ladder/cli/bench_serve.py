"""`ladder bench serve`: latency and throughput of an OpenAI-compatible server under load
(`ladder.bench.serve_load`), a line of results per request rate, and a latency-versus-load picture."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from ladder.bench.records import append_jsonl, environment
from ladder.bench.serve_load import LoadSpec, StartedServer, free_port, run_load
from ladder.cli.common import parse_list
from ladder.console import say
from ladder.errors import LadderError
from ladder.plotting import pyplot, save


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if (args.url is None) == (args.serve is None):
        raise LadderError("give exactly one of --url URL (a running server) or --serve \"ARGS\" (ladder serve ARGS)")
    rates = [float(r) for r in parse_list(args.request_rates, str, "--request-rates")]
    if any(r <= 0 for r in rates) or args.num_requests < 1:
        raise LadderError("--request-rates must be > 0 (inf: all at once) and --num-requests >= 1")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    label = args.label or args.serve or args.url
    say(f"{'rate':>6} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'ITL mean':>9} {'p50':>6} {'p99':>6} "
        f"{'E2E p50':>8}  (ms)")
    if args.serve is not None:
        with StartedServer.ladder(args.serve, free_port()) as server:
            _run_rates(server.url, rates, args, label, out)
    else:
        _run_rates(args.url, rates, args, label, out)
    if args.plot:
        plot_latency_vs_load([json.loads(line) for line in out.read_text().splitlines() if line.strip()], Path(args.plot))
        say(f"wrote {args.plot}")
    return 0


def _run_rates(url: str, rates: list[float], args: argparse.Namespace, label: str, out: Path) -> None:
    for rate in rates:
        spec = LoadSpec(args.num_requests, rate, args.max_concurrency, args.dataset, args.prompt_len, args.output_len,
                        args.byte_prompts, not args.no_ignore_eos, args.seed, args.tokenizer)
        summary = asyncio.run(run_load(url, spec, args.served_model_name))
        record = {"label": label, "request_rate": rate, "server": args.serve or url, **summary,
                  "env": environment(torch.device("cpu"))}
        append_jsonl(out, record)
        t, i, e = summary["ttft_ms"], summary["itl_ms"], summary["e2e_ms"]
        say(f"{rate:>6g} {summary['request_throughput']:>6.2f} {summary['output_throughput']:>7.1f} "
            f"{_ms(t['p50']):>9} {_ms(t['p99']):>7} {_ms(i['mean']):>9} {_ms(i['p50']):>6} {_ms(i['p99']):>6} "
            f"{_ms(e['p50']):>8}" + (f"  ({summary['failed']} failed: {summary['errors'][0]})" if summary["failed"] else ""))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot_latency_vs_load(records: list[dict[str, Any]], path: Path) -> None:
    """Inter-token latency and time to first token (p50) against output throughput, a line per label, a
    point per request rate (the median of its runs when the file holds several)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r["label"] for r in records):
        runs: dict[float, list[dict[str, Any]]] = {}
        for r in records:
            if r["label"] == label:
                runs.setdefault(r["request_rate"], []).append(r)
        points = sorted((statistics.median(r["output_throughput"] for r in rs),
                         statistics.median(r["itl_ms"]["mean"] for r in rs),
                         statistics.median(r["ttft_ms"]["p50"] for r in rs)) for rs in runs.values())
        axes[0].plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        axes[1].plot([p[0] for p in points], [p[2] for p in points], "o-", label=label)
    for ax, name in zip(axes, ("inter-token latency, mean (ms)", "time to first token, p50 (ms)")):
        ax.set_xlabel("output tokens/s (served)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("latency against load")
    save(fig, path, plt)


def add_options(p: argparse.ArgumentParser) -> None:
    """`ladder bench serve`'s options."""
    where = p.add_argument_group("server")
    where.add_argument("--url", help="a running server (ladder's, llama.cpp's, vLLM's), e.g. http://127.0.0.1:8000")
    where.add_argument("--serve", metavar="ARGS", help="start `ladder serve ARGS` for the run, e.g. \"--preset tiny\"")
    where.add_argument("--served-model-name", help="default: the first model the server lists")
    load = p.add_argument_group("load")
    load.add_argument("--request-rates", default="inf", help="comma-separated requests/s (Poisson arrivals); inf: all at once")
    load.add_argument("--num-requests", type=int, default=32)
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    load.add_argument("--dataset", choices=["shakespeare", "fixed"], default="shakespeare",
                      help="shakespeare: a speech as prompt, the next one's length as output; fixed: the lengths below")
    load.add_argument("--prompt-len", type=int, default=64, help="fixed prompts' tokens; shakespeare: the most")
    load.add_argument("--output-len", type=int, default=64, help="fixed outputs' tokens; shakespeare: the most")
    load.add_argument("--byte-prompts", action="store_true", help="prompts as byte ids (a server without tokenizer)")
    load.add_argument("--no-ignore-eos", action="store_true", help="let outputs end at end-of-sequence")
    load.add_argument("--tokenizer", default="smollm2-135m-instruct", help="measures text prompts' lengths")
    load.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", help="this server's name in the results and the picture (default: --serve or --url)")
    p.add_argument("--out", default="runs/bench-serve.jsonl", help="results, a line per rate (appended)")
    p.add_argument("--plot", help="then draw every run in --out into this PNG")
    p.set_defaults(func=cmd_bench_serve)
