"""`ladder predict`: tokens/s per layout from the cost model, and its check against the paper."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ladder.bench.summary import batch_column_width, layout_label
from ladder.checkpoint.resolve import read_shape
from ladder.cli.common import add_quantize_option, parse_hybrids, parse_list
from ladder.comm.links import get_links
from ladder.errors import LadderError
from ladder.model.config import PRESETS
from ladder.predict.costmodel import GPUS, get_gpu, predict_table
from ladder.predict.fit import score, stored_accuracy, validate, validate_unseen
from ladder.predict.paper import UNSEEN_SETTINGS
from ladder.quant.quantize import bytes_per_weight, quantizes_head
from ladder.runtime.memory import MEMORY_USABLE


def cmd_predict(args: argparse.Namespace) -> int:
    if args.validate:
        held_out = validate()
        unseen = {name: validate_unseen(setting) for name, setting in UNSEEN_SETTINGS.items()}
        if args.json:
            print(json.dumps({"held_out": held_out, "unseen": unseen}))
        else:
            print(format_validation(held_out, list(unseen.values())))
        return 0
    links = get_links(parse_list(args.interconnect, str, "--interconnect"), args.link_latency_us,
                      args.link_bandwidth_gbps)
    if None in links:
        raise LadderError("ladder predict needs a link model: --interconnect nvlink-h100, pcie-no-p2p, ... or custom")
    gpu = get_gpu(args.gpu, args.gpu_memory_tbps, args.gpu_tflops, args.gpu_memory_gib)
    tps = parse_list(args.tp, int, "--tp")
    batch_sizes = parse_list(args.batch_sizes, int, "--batch-sizes")
    layouts = parse_list(args.layouts, str, "--layouts")
    hybrids = parse_hybrids(args.ladder_layers)
    model, shape = args.preset, None
    if args.model is not None:
        model, shape = model_label(args.model), read_shape(args.model)
    rows = [row for link in links for tp in tps
            for row in predict_table(model, gpu, link, tp, batch_sizes, layouts, args.prompt_len, args.gen_len,
                                     ladder_layers=hybrids, config=shape, quantize=args.quantize)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    hybrid = "" if hybrids is None else ", ladder[N]: ladder on the last N layers"
    print(f"predicted (cost model, not measured): {model} on {describe_gpu(gpu)}, prompt {args.prompt_len}, "
          f"{args.gen_len} new tokens{hybrid}{quantized_label(args.quantize)}")
    print(format_predictions(rows))
    if not all(r["fits"] for r in rows):
        print(f"does not fit: one rank needs more than {MEMORY_USABLE:.0%} of one {gpu.name}'s "
              f"{gpu.memory_bytes / 2**30:.1f} GiB (weights, KV cache and the prefill's activations)")
    print(stored_accuracy(gpu))
    return 0


def quantized_label(mode: str | None) -> str:
    if mode is None:
        return ""
    linears = "block linears and head" if quantizes_head(mode) else "block linears"
    return f", {linears} {mode} ({bytes_per_weight(mode, 2):g} bytes a weight with scales, bf16 elsewhere)"


def model_label(name_or_path: str) -> str:
    """How tables name a checkpoint: its file or folder (the folder of a bare config.json)."""
    path = Path(name_or_path)
    return path.parent.name if path.name == "config.json" else path.name


def describe_gpu(gpu: Any) -> str:
    """A preset by its name; a GPU given by numbers (custom, or a preset overridden) with them."""
    if GPUS.get(gpu.name) == gpu:
        return gpu.name
    return (f"{gpu.name} ({gpu.hbm_bytes_per_s / 1e12:g} TB/s, {gpu.bf16_flops_per_s / 1e12:g} TFLOP/s, "
            f"{gpu.memory_bytes / 2**30:g} GiB)")


def format_validation(held_out: dict[str, Any], unseen: list[dict[str, Any]]) -> str:
    """The cost model against the paper: its held-out 70B points, then the settings it never saw."""
    lines = ["cost model vs the paper's Llama-3-70B H100 table, held-out batch sizes "
             f"{held_out['held_out_batches']} (fitted on {held_out['train_batches']}):",
             *_validation_table(held_out["points"], with_layout=False),
             f"{score(held_out)} within {held_out['tolerance']} of the published ladder/standard "
             f"speedup ({held_out['fraction_within']:.0%}); * marks the others"]
    for other in unseen:
        lines += ["", f"{other['description']}:", *_validation_table(other["points"], with_layout=True),
                  f"{score(other)} within {other['tolerance']} ({other['fraction_within']:.0%})"]
    return "\n".join(lines)


def _validation_table(points: list[dict[str, Any]], with_layout: bool) -> list[str]:
    """Published against predicted speedup, a line per point; * marks a point outside the tolerance."""
    def layout(text: str) -> str:
        return f"{text:<10}" if with_layout else ""

    lines = [f"{layout('layout')}{'tp':>3}{'batch':>6}{'p2p':>5}{'published':>11}{'predicted':>11}{'error':>8}"]
    for p in points:
        lines.append(f"{layout(p.get('layout', ''))}{p['tp']:>3}{p['batch_size']:>6}{p['p2p']:>5}"
                     f"{p['published']:>11.3f}{p['predicted']:>11.3f}{p['error']:>+8.3f}{'' if p['within'] else '  *'}")
    return lines


def format_predictions(rows: list[dict[str, Any]]) -> str:
    """The predictions as a table; `hidden`: the share of standard's communication ladder hides."""
    batch_width = batch_column_width(rows)
    lines = [f"{'interconnect':<15}{'tp':>3}{'batch':>{batch_width}}  {'layout':<12}{'tokens/s':>10}{'per GPU':>9}"
             f"{'speedup':>9}{'hidden':>8}{'GiB/GPU':>9}"]
    for r in rows:
        where = f"{r['interconnect']:<15}{r['tp']:>3}{r['batch_size']:>{batch_width}}  {layout_label(r):<12}"
        memory = f"{r['memory_bytes_per_gpu'] / 2**30:>9.1f}"
        if not r["fits"]:
            lines.append(f"{where}{'  does not fit':<36}{'':>8}{memory}")
            continue
        hidden = f"{r['hidden']:>8.2f}" if r["hidden"] is not None else f"{'':>8}"
        lines.append(f"{where}{r['tokens_per_s']:>10.1f}{r['tokens_per_s_per_gpu']:>9.1f}{r['speedup']:>9.3f}"
                     f"{hidden}{memory}")
    return "\n".join(lines)


def add_options(pr: argparse.ArgumentParser) -> None:
    """`ladder predict`'s options."""
    pr.add_argument("--preset", default="llama-3-70b", help=f"model shape, one of: {', '.join(PRESETS)}")
    pr.add_argument("--model", help="predict a checkpoint's shape instead of --preset: a Hugging Face folder or "
                    "just its config.json, a GGUF file, or a short name")
    pr.add_argument("--gpu", default="h100", help="h100, h200, a100 or custom")
    pr.add_argument("--gpu-memory-tbps", type=float, help="custom GPU: memory (HBM) bandwidth in TB/s")
    pr.add_argument("--gpu-tflops", type=float, help="custom GPU: dense BF16 TFLOP/s")
    pr.add_argument("--gpu-memory-gib", type=float, help="custom GPU: memory in GiB")
    pr.add_argument("--interconnect", default="nvlink-h100",
                    help="nvlink-h100, pcie-p2p, pcie-no-p2p, infiniband-ndr or custom; comma-separated to compare")
    pr.add_argument("--link-latency-us", type=float, help="custom link: latency per all-reduce (us)")
    pr.add_argument("--link-bandwidth-gbps", type=float, help="custom link: bus bandwidth (GB/s)")
    pr.add_argument("--tp", default="8", help="comma-separated tensor-parallel degrees")
    pr.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated batch sizes")
    pr.add_argument("--layouts", default="standard,parallel,ladder,upper-bound", help="comma-separated layouts")
    pr.add_argument("--ladder-layers", metavar="N[,N...]",
                    help="for the ladder layout: ladder on the last N layers (hybrid); a list predicts one hybrid "
                         "per N")
    add_quantize_option(pr)
    pr.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per sequence")
    pr.add_argument("--gen-len", type=int, default=512, help="new tokens per sequence")
    pr.add_argument("--json", action="store_true",
                    help="one JSON line per prediction (with --validate: the report, one JSON object)")
    pr.add_argument("--validate", action="store_true", help="compare with the paper's held-out table points")
    pr.set_defaults(func=cmd_predict)
