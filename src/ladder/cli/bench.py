"""`ladder bench` (the throughput sweep), `ladder bench summary`, `ladder bench plot` and `ladder bench link`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ladder.bench.calibrate import check_comm_share, dilate_to_share
from ladder.bench.linkbench import (DEFAULT_SIZES, describe_fit, fit_measured_link, format_timings, measure_link,
                                    parse_size, report)
from ladder.bench.plots import plot_bench
from ladder.bench.records import check_results_file, check_trace_folder, measured_already, point_key
from ladder.bench.spec import BenchPoint, check_repetition, sweep_points
from ladder.bench.summary import failures, format_summary, read_bench_files, summarise
from ladder.bench.sweep import run_sweep
from ladder.cli.common import DTYPE_CHOICES, add_quantize_option, decode_step, parse_hybrids, parse_list
from ladder.comm.distributed import pick_device
from ladder.comm.links import LinkModel, get_links
from ladder.console import is_rank0, print_rank0, say
from ladder.errors import LadderError, Stopped, exit_status, stop_message
from ladder.model.config import DEFAULT_DTYPE_HELP, default_dtype

# The default `ladder bench`: a few minutes on a 2-core CPU, into a git-ignored scratch file.
BENCH_DEFAULTS = {"preset": "llama-160m", "layouts": "standard,parallel,ladder,upper-bound", "tp": "2",
                  "batch_sizes": "1,4", "prompt_len": 64, "gen_len": 32, "warmup": 1, "runs": 5,
                  "interconnect": "real", "link_scale": 1.0, "out": "runs/bench.jsonl"}


def cmd_bench(args: argparse.Namespace) -> int:
    links = get_links(parse_list(args.interconnect, str, "--interconnect"), args.link_latency_us,
                      args.link_bandwidth_gbps)
    points, out = plan_sweep(args, links)
    announce_sweep(args, len(points), links, out)
    done = measured_already(out) if args.resume else {}
    if args.comm_share is not None:
        points = dilate_to_share(points, args.comm_share, done, print_rank0)
    if done:
        print_rank0(f"  --resume: {len(done)} successful records in {out}; the configurations among them are "
                    "not measured again")
    try:
        records = run_sweep(points, out, progress=not args.no_progress, rounds=args.rounds,
                            interleave=args.interleave, done=done)
    except (KeyboardInterrupt, Stopped) as exc:
        print_rank0(f"ladder: {stop_message(exc)}; the configurations measured before are in {out}, and the "
                    "same command with --resume measures only the others", file=sys.stderr)
        return exit_status(exc)
    return report_sweep(records, done, out)


def plan_sweep(args: argparse.Namespace, links: list[LinkModel | None]) -> tuple[list[BenchPoint], Path]:
    """The sweep's points and results file, every option checked before anything is announced or
    measured (`--comm-share` times a step first); what runs them trusts them."""
    layouts = args.layouts
    if layouts is None:
        # A checkpoint with two norms per layer cannot become parallel (ladder convert refuses it too).
        layouts = BENCH_DEFAULTS["layouts"] if args.model is None else "standard,ladder,upper-bound"
    presets = parse_list(args.preset, str, "--preset") if args.model is None else [Path(args.model).name]
    points = sweep_points(
        presets=presets,
        layouts=parse_list(layouts, str, "--layouts"),
        tps=parse_list(args.tp, int, "--tp"),
        batch_sizes=parse_list(args.batch_sizes, int, "--batch-sizes"),
        links=links, prompt_len=args.prompt_len, gen_len=args.gen_len, warmup=args.warmup, runs=args.runs,
        device=args.device, dtype=args.dtype, quantize=args.quantize, decode_step=decode_step(args), seed=args.seed,
        link_scale=args.link_scale, ladder_layers=parse_hybrids(args.ladder_layers), checkpoint=args.model,
        profile_dir=args.profile, profile_tokens=args.profile_tokens)
    check_repetition(args.rounds, args.interleave)
    if args.comm_share is not None:
        check_comm_share(points, args.comm_share)
    out = Path(args.out)
    if is_rank0():
        check_results_file(out)
    if args.profile is not None:  # every rank writes its own trace
        check_trace_folder(Path(args.profile))
    return points, out


def announce_sweep(args: argparse.Namespace, n_points: int, links: list[Any], out: Path) -> None:
    """Say what the sweep will measure, and how each emulated link is modelled."""
    # (Under torchrun every rank runs this command: print_rank0, so that rank 0 speaks for all.)
    weights = "random weights" if args.model is None else f"weights of {args.model}"
    print_rank0(f"ladder bench: {n_points} configurations, {weights}, prompt {args.prompt_len}, "
                f"{args.gen_len} new tokens, {args.warmup} warm-up + {args.runs} measured runs each"
                + (f", {args.rounds} rounds" if args.rounds > 1 else "")
                + {"runs": ", layouts interleaved run by run", "steps": ", layouts interleaved step by step"}.get(
                    args.interleave, "") + f" -> {out}")
    dilation = (f"dilated to {args.comm_share:g} of standard's step" if args.comm_share is not None
                else f"times x{args.link_scale:g}")
    for link in links:
        if link is not None:
            print_rank0(f"  emulated link {link.name}: {link.latency_us:.1f} us (+{link.latency_per_rank_us:.1f} us "
                        f"per rank beyond 2) + ring bytes / {link.bandwidth_gbps:.1f} GB/s, "
                        f"{dilation}; {link.source}")


def report_sweep(records: list[dict[str, Any]], done: dict[str, dict[str, Any]], out: Path) -> int:
    """Print the summary table, the counts and each trace's overlap; 1 when nothing could be measured."""
    if not records:
        return 0
    print_rank0(format_summary(summarise(records)))
    for line in failures(records):
        print_rank0(line)
    failed = sum(r["status"] != "ok" for r in records)
    reused = sum(point_key(r, r.get("round", 0)) in done for r in records)
    measured = len(records) - failed - reused
    print_rank0(f"{measured} configurations measured, {failed} failed"
                + (f", {reused} from earlier runs" if reused else "")
                + (f"; results appended to {out}" if measured + failed else f"; nothing new appended to {out}"))
    for r in records:
        if r.get("trace"):
            overlap = (r["trace"]["link"] or {}).get("overlap_fraction")
            shown = f"compute ran during {overlap:.2f} of the communication" if overlap is not None else \
                "no communication visible to the profiler"
            print_rank0(f"trace {r['trace']['path']}: {shown}")
    return 1 if failed == len(records) else 0  # nothing measured: let scripts notice


def cmd_bench_summary(args: argparse.Namespace) -> int:
    records = read_bench_files(args.results)
    rows = summarise(records)
    if args.json:  # for scripts: one object per row on stdout, the failures for people on stderr
        print("\n".join(json.dumps(row) for row in rows))
        for line in failures(records):
            say(line)
    else:
        if rows:
            print(format_summary(rows, markdown=args.markdown))
        for line in failures(records):
            print(f"\n{line}" if args.markdown else line)  # a paragraph each below a Markdown table
    if not rows:
        raise LadderError(f"no configuration in {', '.join(args.results)} was measured")
    return 0


def cmd_bench_link(args: argparse.Namespace) -> int:
    tps = parse_list(args.tp, int, "--tp")
    sizes = [parse_size(text) for text in parse_list(args.sizes, str, "--sizes")]
    device = pick_device(args.device)
    dtype = args.dtype or default_dtype(device.type)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not args.json:
        print_rank0(f"ladder bench link: all-reduce of {dtype} on {device.type} ({backend}), tp "
                    f"{', '.join(map(str, tps))}: {args.warmup} warm-up + {args.iters} timed each, one at a time; "
                    "the slowest rank's median")
    timings = measure_link(tps, sizes, dtype, args.device, args.warmup, args.iters)
    link = fit_measured_link(timings, f"{os.uname().nodename} ({device.type}, {backend})")
    if args.json:
        print_rank0(json.dumps(report(timings, link)))
    else:
        print_rank0(format_timings(timings, link))
        for line in describe_fit(link, timings):
            print_rank0(line)
    return 0


def cmd_bench_plot(args: argparse.Namespace) -> int:
    records = read_bench_files(args.results)
    paths, not_drawn = plot_bench(records, Path(args.out_dir) if args.out_dir else None, Path(args.results[0]))
    print("\n".join(map(str, paths + not_drawn)))
    return 0


def add_options(b: argparse.ArgumentParser) -> None:
    """`ladder bench`'s options."""
    b.add_argument("--preset", default=BENCH_DEFAULTS["preset"], help="model shape(s), comma-separated")
    b.add_argument("--model", help="measure a real checkpoint (GGUF file, Hugging Face folder or short name) "
                                   "instead of random weights of --preset")
    b.add_argument("--layouts", help=f"comma-separated layouts (default: {BENCH_DEFAULTS['layouts']}; "
                                     "without parallel for --model)")
    b.add_argument("--ladder-layers", metavar="N[,N...]",
                   help="for the ladder layout: ladder on the last N layers (hybrid); a list measures one hybrid "
                        "per N, each against the same whole baselines")
    b.add_argument("--tp", default=BENCH_DEFAULTS["tp"], help="comma-separated TP degrees")
    b.add_argument("--batch-sizes", default=BENCH_DEFAULTS["batch_sizes"], help="comma-separated batch sizes")
    b.add_argument("--prompt-len", type=int, default=BENCH_DEFAULTS["prompt_len"],
                   help="prompt tokens per sequence, 1024 in the paper")
    b.add_argument("--gen-len", type=int, default=BENCH_DEFAULTS["gen_len"],
                   help="new tokens per sequence, 512 in the paper")
    b.add_argument("--warmup", type=int, default=BENCH_DEFAULTS["warmup"], help="warm-up runs (excluded)")
    b.add_argument("--runs", type=int, default=BENCH_DEFAULTS["runs"], help="measured runs")
    b.add_argument("--rounds", type=int, default=1,
                   help="repeat the sweep, configurations interleaved; the summary pools every round")
    b.add_argument("--interleave", nargs="?", const="runs", choices=("runs", "steps"),
                   help="measure the layouts of each configuration in one set of workers, taking turns run by "
                        "run (or step by step: --interleave steps), so a noisy machine's drift hits them alike "
                        "(weights shared where layouts allow)")
    b.add_argument("--interconnect", default=BENCH_DEFAULTS["interconnect"],
                   help="real (torch.distributed), nvlink-h100, pcie-p2p, pcie-no-p2p, infiniband-ndr or "
                        "custom; comma-separated to compare")
    b.add_argument("--link-latency-us", type=float, help="custom link: latency per all-reduce (us)")
    b.add_argument("--link-bandwidth-gbps", type=float, help="custom link: bus bandwidth (GB/s)")
    b.add_argument("--comm-share", type=float, default=None, metavar="S",
                   help="instead of --link-scale: dilate each emulated configuration's link so that its "
                        "all-reduces take this share of standard's decode step on this machine (CPU; "
                        "calibrated before the sweep), e.g. 0.25")
    b.add_argument("--link-scale", type=float, default=BENCH_DEFAULTS["link_scale"],
                   help="multiply emulated link times (keep a GPU's compute:communication ratio on a slower device)")
    b.add_argument("--device", default="auto", help="cpu, cuda or auto")
    b.add_argument("--dtype", choices=DTYPE_CHOICES, help=DEFAULT_DTYPE_HELP)
    add_quantize_option(b)
    b.add_argument("--compile", action="store_true",
                   help="compile the whole decode step (CUDA graphs on GPU; minutes for a large model)")
    b.add_argument("--compile-layers", action="store_true",
                   help="compile each layer's attention and MLP once for all layers, the step between them "
                        "eager (seconds for any depth); with --cuda-graph on GPU the step is one CUDA graph")
    b.add_argument("--cuda-graph", action="store_true",
                   help="capture the decode step (eager, or with --compile-layers) as one CUDA graph (GPU; "
                        "ready in one step)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    b.add_argument("--out", default=BENCH_DEFAULTS["out"], help="JSON-lines results file (appended)")
    b.add_argument("--resume", action="store_true",
                   help="skip configurations (and rounds) already measured successfully in --out")
    b.add_argument("--profile", metavar="DIR", help="also write a profiler trace (Chrome JSON) of one short extra "
                                                     "run per configuration, and read the overlap back from it")
    b.add_argument("--profile-tokens", type=int, default=8, help="new tokens of the profiled run")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)


def add_summary_options(bs: argparse.ArgumentParser) -> None:
    """`ladder bench summary`'s options."""
    bs.add_argument("results", nargs="+", help="results files; the runs of a configuration are pooled across them")
    how = bs.add_mutually_exclusive_group()
    how.add_argument("--markdown", action="store_true", help="a Markdown table")
    how.add_argument("--json", action="store_true", help="one JSON object per row (what the table shows, and more)")
    bs.set_defaults(func=cmd_bench_summary)


def add_plot_options(bp: argparse.ArgumentParser) -> None:
    """`ladder bench plot`'s options."""
    bp.add_argument("results", nargs="+", help="results files written by ladder bench; the runs of a configuration "
                    "are pooled across them, as in bench summary")
    bp.add_argument("--out-dir", default=None, help="where to write the PNGs (default: beside the first results file)")
    bp.set_defaults(func=cmd_bench_plot)


def add_link_options(bl: argparse.ArgumentParser) -> None:
    """`ladder bench link`'s options."""
    bl.add_argument("--tp", default="2", help="comma-separated numbers of ranks to time it over")
    bl.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes in bytes (K, M, G: KiB...)")
    bl.add_argument("--device", default="auto", help="cpu (gloo), cuda (NCCL) or auto")
    bl.add_argument("--dtype", choices=DTYPE_CHOICES, help=DEFAULT_DTYPE_HELP)
    bl.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size")
    bl.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    bl.add_argument("--json", action="store_true", help="one JSON object: the timings and the fitted link")
    bl.set_defaults(func=cmd_bench_link)
