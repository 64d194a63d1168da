"""The `ladder` command line: one thin layer over typed functions.

Every user error is a `LadderError`, printed as one line (`ladder: error: ...`) with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ladder.config import DESYNC_PATTERNS, LAYOUTS, PRESETS
from ladder.distributed import is_rank0
from ladder.errors import LadderError, Stopped, check_creatable
from ladder.loader import DTYPES, ModelSpec
from ladder.tokenizer import TextTokenizer
from ladder.train import settings_help

# The default `ladder bench` is the README's run command: a few minutes on a 2-core CPU.
BENCH_DEFAULTS = {"preset": "llama-160m", "layouts": "standard,parallel,ladder,upper-bound", "tp": "2",
                  "batch_sizes": "1,4", "prompt_len": 64, "gen_len": 32, "warmup": 1, "runs": 5,
                  "interconnect": "real", "link_scale": 1.0, "out": "results/bench.jsonl"}


def info(message: str) -> None:
    """Status lines go to stderr (rank 0 only), so stdout carries only the answer."""
    if is_rank0():
        print(message, file=sys.stderr, flush=True)


def say(line: str) -> None:
    """One line on stderr in one write. Under torchrun every rank may say the same line at once into
    one pipe; print's two writes (the text, then the newline) interleave them into a garbled line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# ---- model selection shared by every subcommand ---------------------------------------------------

def add_model_options(p: argparse.ArgumentParser, tp_flag: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="a GGUF file, a Hugging Face folder, or a short name (smollm2-135m-instruct)")
    g.add_argument("--preset", default="tiny", help=f"model shape with random weights, one of: {', '.join(PRESETS)}")
    g.add_argument("--layout", help=f"residual layout, one of: {', '.join(LAYOUTS)} (default: the model's)")
    g.add_argument("--ladder-layers", type=int, metavar="N", help="ladder on the last N layers (hybrid)")
    g.add_argument("--desync-reduce", choices=DESYNC_PATTERNS, help="which modules desync all-reduces")
    if tp_flag:
        g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (starts N local workers)")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
    g.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--shard-vocab", action="store_true", help="shard the output head's vocabulary")
    g.add_argument("--seed", type=int, default=0, help="seed for random weights and sampling")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(preset=args.preset, model=args.model, layout=args.layout, ladder_layers=args.ladder_layers,
                     desync_reduce=args.desync_reduce, tp=getattr(args, "tp", 1), device=args.device,
                     dtype=args.dtype, shard_vocab=args.shard_vocab, seed=args.seed)


# ---- generate -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerateRequest:
    model: ModelSpec
    max_new_tokens: int
    prompt_ids: list[list[int]] | None = None  # token ids, or text below (needs a tokenizer)
    prompt: str | None = None
    chat: str | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] = ()
    compile: bool = False
    compile_layers: bool = False


def parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise LadderError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise LadderError(f"{flag} is empty")
    return ids


def _prompt_tensor(req: GenerateRequest, tokenizer: TextTokenizer | None, vocab: int) -> torch.Tensor:
    if req.prompt_ids is not None:
        bad = [t for p in req.prompt_ids for t in p if not 0 <= t < vocab]
        if bad:
            raise LadderError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return torch.tensor(req.prompt_ids, dtype=torch.long)
    if tokenizer is None:
        raise LadderError("this model has no tokenizer: give --prompt-ids instead of text")
    if req.chat is not None:
        text = tokenizer.render_chat([{"role": "user", "content": req.chat}])
        ids = tokenizer.encode(text, add_bos=False)  # the template writes its own special tokens
    else:
        ids = tokenizer.encode(req.prompt or "")
    if not ids:
        raise LadderError("the prompt is empty")
    return torch.tensor([ids], dtype=torch.long)


def generate_on_rank(req: GenerateRequest) -> list[list[int]]:
    """One rank's share of `ladder generate` (runs in each worker process)."""
    from ladder.distributed import check_ranks_agree, init_distributed, print_rank0, shutdown_distributed
    from ladder.engine import Engine, SamplingParams
    from ladder.loader import describe, load_model
    from ladder.tokenizer import StreamDecoder

    ctx = init_distributed(req.model.device)
    try:
        loaded = load_model(req.model, ctx.communicator(), ctx.device)
        tokenizer = loaded.tokenizer
        prompt = _prompt_tensor(req, tokenizer, loaded.model.config.vocab_size)
        check_ranks_agree((req, prompt.tolist()), "options or prompt tokens")
        info(f"ladder: {describe(loaded, req.model)}")
        if loaded.random_weights:
            info("ladder: weights are RANDOM: the generated ids are not meaningful text")
        engine = Engine(loaded.model, compile=req.compile, compile_layers=req.compile_layers)
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.model.seed)
        text_mode = req.prompt_ids is None
        stop_ids = tuple(req.stop_ids) + (tuple(tokenizer.stop_ids) if text_mode and tokenizer else ())
        batch = prompt.shape[0]
        stream = StreamDecoder(tokenizer) if text_mode else None

        def on_token(token: torch.Tensor) -> None:
            if stream is not None:
                if int(token[0]) not in stop_ids:
                    print_rank0(stream.push(int(token[0])), end="")
            elif batch == 1:
                print_rank0(f"{int(token[0])} ", end="")

        if not text_mode and batch == 1:
            print_rank0("generated: ", end="")
        result = engine.generate(prompt, req.max_new_tokens, sampling, stop_ids, on_token)
        if text_mode or batch == 1:
            print_rank0()
        else:
            for i, row in enumerate(result.tokens):
                print_rank0(f"generated[{i}]: {' '.join(map(str, row))}")
        n = result.n_generated
        info(f"ladder: {n} tokens, prefill {prompt.shape[1]} tokens in {result.prefill_s * 1e3:.0f} ms, decode "
             f"{batch * max(n - 1, 0) / max(result.decode_s, 1e-9):.1f} tokens/s")
        return result.tokens
    finally:
        shutdown_distributed()


def cmd_generate(args: argparse.Namespace) -> int:
    from ladder.engine import SamplingParams
    from ladder.launch import launch

    spec = model_spec(args)
    config = spec.validate()
    given = [x is not None for x in (args.prompt_ids, args.prompt, args.chat)]
    if sum(given) != 1:
        raise LadderError("give exactly one of --prompt TEXT, --chat TEXT or --prompt-ids 1,2,3")
    if args.max_new_tokens < 1:
        raise LadderError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.compile and args.compile_layers:
        raise LadderError("give one of --compile (the whole decode step) and --compile-layers (each layer)")
    SamplingParams(args.temperature, args.top_k, args.top_p)  # its checks, before the minutes of loading
    prompts = [parse_ids(p, "--prompt-ids") for p in args.prompt_ids] if args.prompt_ids else None
    if prompts:
        if len({len(p) for p in prompts}) > 1:
            raise LadderError(f"batched prompts must have equal lengths, got {[len(p) for p in prompts]}")
        if config is not None:
            total = len(prompts[0]) + args.max_new_tokens
            if total > config.max_seq_len:
                raise LadderError(f"prompt of {len(prompts[0])} tokens + {args.max_new_tokens} new tokens = {total} "
                                  f"exceeds the model's max_seq_len {config.max_seq_len}")
            bad = [t for p in prompts for t in p if not 0 <= t < config.vocab_size]
            if bad:
                raise LadderError(f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    stop_ids = tuple(parse_ids(args.stop_ids, "--stop-ids")) if args.stop_ids else ()
    req = GenerateRequest(model=spec, max_new_tokens=args.max_new_tokens, prompt_ids=prompts, prompt=args.prompt,
                          chat=args.chat, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          stop_ids=stop_ids, compile=args.compile, compile_layers=args.compile_layers)
    launch(generate_on_rank, spec.tp, req, device=spec.device)
    return 0


# ---- eval -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalRequest:
    model: ModelSpec
    text_file: str
    window: int
    stride: int
    max_tokens: int | None


def eval_on_rank(req: EvalRequest) -> dict:
    from ladder.distributed import check_ranks_agree, fingerprint, init_distributed, shutdown_distributed
    from ladder.evaluate import perplexity
    from ladder.loader import describe, load_model

    ctx = init_distributed(req.model.device)
    try:
        loaded = load_model(req.model, ctx.communicator(), ctx.device)
        if loaded.tokenizer is None:
            raise LadderError("this model has no tokenizer, so it cannot read a text file")
        info(f"ladder: {describe(loaded, req.model)}")
        text = Path(req.text_file).read_text(encoding="utf-8", errors="replace")
        ids = loaded.tokenizer.encode(text)
        if req.max_tokens:
            ids = ids[: req.max_tokens]
        check_ranks_agree((req, fingerprint(ids)), "options or tokens of --text")
        result = perplexity(loaded.model, ids, req.window, req.stride, progress=ctx.is_main)
        result.update(model=req.model.label, text=req.text_file, layout=loaded.model.config.layout_name,
                      ladder_layers=loaded.model.config.n_ladder_layers, tp=ctx.world_size)
        return result
    finally:
        shutdown_distributed()


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from ladder.launch import launch

    spec = model_spec(args)
    spec.validate()
    if not Path(args.text).is_file():
        raise LadderError(f"no text file at {args.text}")
    stride = args.window if args.stride is None else args.stride
    if not 0 < stride <= args.window:
        raise LadderError(f"--stride must be between 1 and --window ({args.window}), got {stride}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise LadderError(f"--max-tokens must be >= 2 (a token is scored given the ones before it), got {args.max_tokens}")
    result = launch(eval_on_rank, spec.tp, EvalRequest(spec, args.text, args.window, stride, args.max_tokens),
                    device=spec.device).get(0)
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {result['perplexity']:.3f} ({result['model']}, {result['layout']}, tp={result['tp']}) over "
              f"{result['n_scored']} tokens of {args.text}; {result['method']}")
    return 0


# ---- convert --------------------------------------------------------------------------------------

def cmd_convert(args: argparse.Namespace) -> int:
    from ladder.checkpoint import check_replaceable, save_hf
    from ladder.distributed import LocalCommunicator, pick_device
    from ladder.loader import describe, load_model
    from ladder.weights import export_hf_state_dict

    spec = ModelSpec(model=args.src, layout=args.layout, ladder_layers=args.ladder_layers,
                     desync_reduce=args.desync_reduce, device="cpu", dtype="float32")
    spec.validate()
    out = Path(args.out).expanduser().resolve()
    check_replaceable(out, args.force)  # before the minutes of loading
    loaded = load_model(spec, LocalCommunicator(), pick_device("cpu"))
    info(f"ladder: {describe(loaded, spec)}")
    path = save_hf(out, loaded.model.config, export_hf_state_dict(loaded.model), loaded.tokenizer, force=args.force)
    print(f"wrote {path} ({loaded.model.config.layout_name})")
    return 0


# ---- bench ----------------------------------------------------------------------------------------

def parse_list(text: str, kind: type = str, flag: str = "") -> list:
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LadderError(f"{flag} expects a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not items:
        raise LadderError(f"{flag} is empty")
    twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
    if twice is not None:  # every list is a sweep axis: a repeat would measure a configuration twice over
        raise LadderError(f"{flag} lists {twice} twice")
    return items


def parse_hybrids(text: str | None) -> list[int] | None:
    """`--ladder-layers 20,40` of bench and predict: the N of each hybrid to compare, or None (whole ladder)."""
    return None if text is None else parse_list(text, int, "--ladder-layers")


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ladder.bench import (check_comm_share, check_repetition, check_results_file, check_trace_folder,
                              dilate_to_share, measured_already, run_sweep, sweep_points)
    from ladder.distributed import print_rank0
    from ladder.interconnect import get_links

    links = get_links(parse_list(args.interconnect, str, "--interconnect"), args.link_latency_us,
                      args.link_bandwidth_gbps)
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
        device=args.device, dtype=args.dtype, compile=args.compile, cuda_graph=args.cuda_graph,
        compile_layers=args.compile_layers, seed=args.seed,
        link_scale=args.link_scale, ladder_layers=parse_hybrids(args.ladder_layers), checkpoint=args.model,
        profile_dir=args.profile, profile_tokens=args.profile_tokens)
    check_repetition(args.rounds, args.interleave)
    if args.comm_share is not None:
        check_comm_share(points, args.comm_share)
    out = Path(args.out)
    if is_rank0():  # before anything is announced or measured (--comm-share times a step first)
        check_results_file(out)
    if args.profile is not None:  # every rank writes its own trace
        check_trace_folder(Path(args.profile))
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


def announce_sweep(args: argparse.Namespace, n_points: int, links: list[Any], out: Path) -> None:
    """Say what the sweep will measure, and how each emulated link is modelled."""
    from ladder.distributed import print_rank0

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
    from ladder.bench import point_key
    from ladder.results import failures, format_summary, summarise
    from ladder.distributed import print_rank0

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
    from ladder.results import failures, format_summary, read_bench_files, summarise

    records = read_bench_files(args.results)
    rows = summarise(records)
    if args.json:  # for scripts: one object per row on stdout, the failures for people on stderr
        import json

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
    import json

    from ladder.distributed import pick_device, print_rank0
    from ladder.linkbench import (describe_fit, fit_measured_link, format_timings, measure_link, parse_size,
                                  report)

    tps = parse_list(args.tp, int, "--tp")
    sizes = [parse_size(text) for text in parse_list(args.sizes, str, "--sizes")]
    device = pick_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
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
    from pathlib import Path

    from ladder.results import read_bench_files
    from ladder.plots import plot_bench

    records = read_bench_files(args.results)
    paths, not_drawn = plot_bench(records, Path(args.out_dir) if args.out_dir else None, Path(args.results[0]))
    print("\n".join(map(str, paths + not_drawn)))
    return 0


# ---- predict --------------------------------------------------------------------------------------

def cmd_predict(args: argparse.Namespace) -> int:
    import json

    from ladder.costmodel import (UNSEEN_SETTINGS, fitted_constants, get_gpu, predict_table, stored_accuracy,
                                  validate, validate_unseen)
    from ladder.interconnect import get_links

    if args.validate:
        constants = fitted_constants()
        held_out = validate(constants)
        unseen = {name: validate_unseen(setting, constants) for name, setting in UNSEEN_SETTINGS.items()}
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
        from ladder.checkpoint import read_shape

        model, shape = model_label(args.model), read_shape(args.model)
    rows = [row for link in links for tp in tps
            for row in predict_table(model, gpu, link, tp, batch_sizes, layouts, args.prompt_len, args.gen_len,
                                     ladder_layers=hybrids, config=shape)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    hybrid = "" if hybrids is None else ", ladder[N]: ladder on the last N layers"
    print(f"predicted (cost model, not measured): {model} on {describe_gpu(gpu)}, prompt {args.prompt_len}, "
          f"{args.gen_len} new tokens{hybrid}")
    print(format_predictions(rows))
    if not all(r["fits"] for r in rows):
        from ladder.bench import MEMORY_USABLE
        print(f"does not fit: one rank needs more than {MEMORY_USABLE:.0%} of one {gpu.name}'s "
              f"{gpu.memory_bytes / 2**30:.1f} GiB (weights, KV cache and the prefill's activations)")
    print(stored_accuracy(gpu))
    return 0


def model_label(name_or_path: str) -> str:
    """How tables name a checkpoint: its file or folder (the folder of a bare config.json)."""
    path = Path(name_or_path)
    return path.parent.name if path.name == "config.json" else path.name


def describe_gpu(gpu: Any) -> str:
    """A preset by its name; a GPU given by numbers (custom, or a preset overridden) with them."""
    from ladder.costmodel import GPUS

    if GPUS.get(gpu.name) == gpu:
        return gpu.name
    return (f"{gpu.name} ({gpu.hbm_bytes_per_s / 1e12:g} TB/s, {gpu.bf16_flops_per_s / 1e12:g} TFLOP/s, "
            f"{gpu.memory_bytes / 2**30:g} GiB)")


def format_validation(held_out: dict[str, Any], unseen: list[dict[str, Any]]) -> str:
    """The cost model against the paper: its held-out 70B points, then the settings it never saw."""
    from ladder.costmodel import score

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
    from ladder.results import batch_column_width, layout_label

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


# ---- train ----------------------------------------------------------------------------------------

def train_on_rank(config: object, resume: bool, progress: bool) -> dict:
    from ladder.train import train

    result = train(config, resume=resume, progress=progress)  # type: ignore[arg-type]
    return {"losses": result.losses, "final_dir": str(result.final_dir), "eval_loss": result.eval_loss}


def cmd_train(args: argparse.Namespace) -> int:
    import math

    from ladder.launch import launch
    from ladder.train import load_train_config

    config = load_train_config(args.config, args.overrides)
    check_creatable(Path(config.out_dir) / "metrics.jsonl")  # before the workers start, not after the first steps
    results = launch(train_on_rank, args.nproc, config, args.resume, not args.no_progress, flag="--nproc",
                     device=config.device, workers_catch_interrupt=True)
    result = results.get(0)
    if result:
        eval_text = (f", held-out loss {result['eval_loss']:.4f} (perplexity {math.exp(result['eval_loss']):.2f})"
                     if result["eval_loss"] is not None else "")
        losses = result["losses"]
        last = f"final train loss {losses[-1]:.4f}" if losses else "nothing left to train"
        print(f"{last}{eval_text}; model written to {result['final_dir']}")
    return 0


def cmd_train_plot(args: argparse.Namespace) -> int:
    from ladder.plots import plot_training

    print(plot_training([Path(r) for r in args.runs], Path(args.out)))
    return 0


# ---- entry point ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladder", description="Ladder-Residual transformers: run, "
                                     "benchmark and convert models with every residual layout.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in (_generate_parser, _eval_parser, _convert_parser, _bench_parser, _predict_parser,
                       _train_parser, _train_plot_parser, _bench_summary_parser, _bench_plot_parser,
                       _bench_link_parser):
        say_defaults(add_parser(sub))
    return parser


def _generate_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder generate`'s options."""
    g = sub.add_parser("generate", help="generate text (or ids) with any model, layout and TP degree")
    add_model_options(g)
    g.add_argument("--chat", metavar="TEXT", help="a user message, wrapped in the model's chat template")
    g.add_argument("--prompt", metavar="TEXT", help="plain text to continue")
    g.add_argument("--prompt-ids", action="append", metavar="IDS",
                   help="comma-separated prompt token ids; repeat for a batch of equal-length prompts")
    g.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per sequence")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    g.add_argument("--top-p", type=float, help="sample from the smallest set of tokens whose probability reaches p")
    g.add_argument("--stop-ids", help="comma-separated ids that end a sequence")
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    g.add_argument("--compile-layers", action="store_true",
                   help="torch.compile each layer's attention and MLP, one graph for all layers (seconds for any depth)")
    g.set_defaults(func=cmd_generate)
    return g


def _eval_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder eval`'s options."""
    e = sub.add_parser("eval", help="perplexity of a model on a text file")
    add_model_options(e)
    e.add_argument("--text", required=True, help="a UTF-8 text file")
    e.add_argument("--window", type=int, default=512, help="tokens of context per forward")
    e.add_argument("--stride", type=int, help="tokens scored per window (< window: sliding; default: chunked)")
    e.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the file")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval)
    return e


def _convert_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder convert`'s options."""
    c = sub.add_parser("convert", help="convert a checkpoint to a residual layout, write a Hugging Face folder")
    c.add_argument("src", help="a GGUF file, a Hugging Face folder, or a short name")
    c.add_argument("--out", required=True, help="the folder to write (atomically)")
    c.add_argument("--ladder-layers", type=int, metavar="N", help="ladder on the last N layers")
    c.add_argument("--layout", help=f"target layout, one of: {', '.join(LAYOUTS)}")
    c.add_argument("--desync-reduce", choices=DESYNC_PATTERNS)
    c.add_argument("--force", action="store_true", help="replace --out if it exists")
    c.set_defaults(func=cmd_convert)
    return c


def _bench_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder bench`'s options."""
    b = sub.add_parser("bench", help="throughput sweep over layouts x TP x batch (see also: ladder bench plot, "
                       "summary and link)")
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
    b.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
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
    return b


def _predict_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder predict`'s options."""
    pr = sub.add_parser("predict", help="predict tokens/s per layout from a roofline + link cost model")
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
    pr.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per sequence")
    pr.add_argument("--gen-len", type=int, default=512, help="new tokens per sequence")
    pr.add_argument("--json", action="store_true",
                    help="one JSON line per prediction (with --validate: the report, one JSON object)")
    pr.add_argument("--validate", action="store_true", help="compare with the paper's held-out table points")
    pr.set_defaults(func=cmd_predict)
    return pr


def _train_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder train`'s options."""
    t = sub.add_parser("train", help="pretrain from a preset or adapt a checkpoint (see also: ladder train plot)",
                       epilog=settings_help())
    t.add_argument("--config", help="a YAML or TOML file of train settings")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings that override the file")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir")
    t.add_argument("--nproc", type=int, default=1, help="data-parallel workers to start on this machine")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)
    return t


def _train_plot_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder train plot`'s options."""
    tp_ = sub.add_parser("train-plot", prog="ladder train plot",
                         help="loss curves of runs on one picture (also: ladder train plot RUN...)")
    tp_.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl)")
    tp_.add_argument("--out", default="loss.png", help="the picture to write")
    tp_.set_defaults(func=cmd_train_plot)
    return tp_


def _bench_summary_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder bench summary`'s options."""
    bs = sub.add_parser("bench-summary", prog="ladder bench summary",
                        help="the speedup table of results files, then the configurations that failed "
                             "(also: ladder bench summary FILE...)")
    bs.add_argument("results", nargs="+", help="results files; the runs of a configuration are pooled across them")
    how = bs.add_mutually_exclusive_group()
    how.add_argument("--markdown", action="store_true", help="a Markdown table")
    how.add_argument("--json", action="store_true", help="one JSON object per row (what the table shows, and more)")
    bs.set_defaults(func=cmd_bench_summary)
    return bs


def _bench_plot_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder bench plot`'s options."""
    bp = sub.add_parser("bench-plot", prog="ladder bench plot",
                        help="draw the pictures of results files (also: ladder bench plot FILE...)")
    bp.add_argument("results", nargs="+", help="results files written by ladder bench; the runs of a configuration "
                    "are pooled across them, as in bench summary")
    bp.add_argument("--out-dir", default=None, help="where to write the PNGs (default: beside the first results file)")
    bp.set_defaults(func=cmd_bench_plot)
    return bp


def _bench_link_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder bench link`'s options."""
    from ladder.linkbench import DEFAULT_SIZES

    bl = sub.add_parser("bench-link", prog="ladder bench link",
                        help="time this machine's all-reduce by message size and fit the link model "
                             "--interconnect custom takes (also: ladder bench link)")
    bl.add_argument("--tp", default="2", help="comma-separated numbers of ranks to time it over")
    bl.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes in bytes (K, M, G: KiB...)")
    bl.add_argument("--device", default="auto", help="cpu (gloo), cuda (NCCL) or auto")
    bl.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    bl.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size")
    bl.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    bl.add_argument("--json", action="store_true", help="one JSON object: the timings and the fitted link")
    bl.set_defaults(func=cmd_bench_link)
    return bl


def say_defaults(parser: argparse.ArgumentParser) -> None:
    """Make --help name every option's default (argparse prints none, and none for options without help)."""
    for action in parser._actions:
        text = action.help or ""
        no_default = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not no_default and "default" not in text:
            action.help = f"{text} (default: %(default)s)".lstrip()


def stop_message(stop: BaseException) -> str:
    """"interrupted", "interrupted: saved step 40 to ...", "stopped by SIGTERM[: saved step ...]"."""
    if isinstance(stop, Stopped):
        return str(stop)
    return "interrupted" + (f": {stop}" if str(stop) else "")


def exit_status(stop: BaseException) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (Ctrl-C: 130)."""
    return 128 + (stop.signum if isinstance(stop, Stopped) else signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] in (["bench", "plot"], ["bench", "summary"], ["bench", "link"], ["train", "plot"]):  # reads better
        argv = [f"{argv[0]}-{argv[1]}", *argv[2:]]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "train":  # settings may also follow options: --nproc 2 lr=1e-3
        args.overrides += [item for item in unknown if "=" in item and not item.startswith("-")]
        unknown = [item for item in unknown if item not in args.overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except LadderError as exc:
        say(f"ladder: error: {exc}")
        return 2
    except (KeyboardInterrupt, Stopped) as exc:
        say(f"ladder: {stop_message(exc)}")
        return exit_status(exc)
    except RuntimeError as exc:
        from ladder.distributed import communication_failure

        said = communication_failure(exc)
        if said is None:
            raise
        say(f"ladder: error: {said}")
        return 1
    except BrokenPipeError:  # output piped into `head` and closed early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # the file system refused (full disk, permissions): the environment, not a bug
        say(f"ladder: error: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        return 1


if __name__ == "__main__":
    sys.exit(main())
