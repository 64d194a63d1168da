"""`ladder eval`: a model's quality at any layout and TP degree, as perplexity of a text file (beside a
reference model, `--reference`), or through EleutherAI's lm-evaluation-harness (`--tasks`)."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladder.cli.common import add_model_options, info, model_spec, parse_list
from ladder.comm.distributed import check_ranks_agree, fingerprint, init_distributed, shutdown_distributed
from ladder.comm.launch import launch
from ladder.errors import LadderError, check_creatable
from ladder.evaluate import compare, perplexity
from ladder.files import write_text
from ladder.harness import ladder_lm, task_manager
from ladder.model.spec import ModelSpec


@dataclass(frozen=True)
class EvalRequest:
    model: ModelSpec
    text_file: str
    window: int
    stride: int
    max_tokens: int | None
    reference: ModelSpec | None = None  # compared with, token for token (`ladder.evaluate.compare`)


@dataclass(frozen=True)
class TasksRequest:
    model: ModelSpec
    tasks: list[str]
    num_fewshot: int | None
    limit: float | None
    batch_size: int
    max_length: int | None
    include_paths: list[str]
    seed: int


def eval_on_rank(req: EvalRequest) -> dict:
    ctx = init_distributed(req.model.device)
    try:
        loaded = req.model.load(ctx.communicator(), ctx.device)
        if loaded.tokenizer is None:
            raise LadderError("this model has no tokenizer, so it cannot read a text file")
        info(f"ladder: {req.model.describe(loaded)}")
        text = Path(req.text_file).read_text(encoding="utf-8", errors="replace")
        ids = loaded.tokenizer.encode(text)
        if req.max_tokens:
            ids = ids[: req.max_tokens]
        check_ranks_agree((req, fingerprint(ids)), "options or tokens of --text")
        if req.reference is None:
            result = perplexity(loaded.model, ids, req.window, req.stride, progress=ctx.is_main)
        else:
            reference = req.reference.load(ctx.communicator(), ctx.device).model
            result = compare(loaded.model, reference, ids, req.window, progress=ctx.is_main)
            result.update(reference=req.reference.label, reference_layout=reference.config.layout_name)
        result.update(model=req.model.label, text=req.text_file, layout=loaded.model.config.layout_name,
                      ladder_layers=loaded.model.config.n_ladder_layers, tp=ctx.world_size)
        return result
    finally:
        shutdown_distributed()


def tasks_on_rank(req: TasksRequest) -> dict | None:
    """lm-eval's tasks on this rank's shard; every rank runs the same requests, rank 0 reports."""
    # lm-eval and its datasets take seconds to import: only `ladder eval --tasks` pays for them.
    try:
        from lm_eval import simple_evaluate
    except ImportError:
        raise LadderError('--tasks needs lm-evaluation-harness: pip install "lm-eval[api]==0.4.13"') from None
    ctx = init_distributed(req.model.device)
    try:
        check_ranks_agree(req, "options")
        # lm-eval warns of what ladder's offline tasks do on purpose (a dataset loaded by a function)
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        manager = task_manager(req.tasks, req.include_paths)
        unknown = [t for t in req.tasks if t not in manager.all_tasks]
        if unknown:
            raise LadderError(f"unknown task {unknown[0]!r}: ladder's offline tasks are "
                              f"{', '.join(sorted(t for t in manager.all_tasks if t.startswith('ladder_')))} "
                              "(or any lm-eval task; --include-path adds a folder of your own)")
        loaded = req.model.load(ctx.communicator(), ctx.device)
        if loaded.tokenizer is None:
            raise LadderError("this model has no tokenizer: lm-eval's tasks are text")
        info(f"ladder: {req.model.describe(loaded)}")
        lm = ladder_lm(loaded.model, loaded.tokenizer, req.batch_size, req.max_length, quiet=not ctx.is_main)
        results = simple_evaluate(model=lm, tasks=req.tasks, num_fewshot=req.num_fewshot, limit=req.limit,
                                  task_manager=manager, random_seed=req.seed, numpy_random_seed=req.seed,
                                  torch_random_seed=req.seed, fewshot_random_seed=req.seed, log_samples=False)
        if not ctx.is_main or results is None:
            return None
        return {"results": results["results"], "n-shot": results.get("n-shot"), "versions": results.get("versions"),
                "model": req.model.label, "layout": loaded.model.config.layout_name, "tp": ctx.world_size,
                "table": _table(results)}
    finally:
        shutdown_distributed()


def _table(results: dict[str, Any]) -> str:
    from lm_eval.utils import make_table  # (with lm-eval, which the caller imported)

    return make_table(results)


def cmd_eval(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    spec.validate()
    if (args.text is None) == (args.tasks is None):
        raise LadderError("give --text FILE (perplexity) or --tasks T1,T2 (lm-evaluation-harness), one of them")
    if args.output:
        check_creatable(Path(args.output))
    if args.tasks is not None:
        return _run_tasks(args, spec)
    if not Path(args.text).is_file():
        raise LadderError(f"no text file at {args.text}")
    stride = args.window if args.stride is None else args.stride
    if not 0 < stride <= args.window:
        raise LadderError(f"--stride must be between 1 and --window ({args.window}), got {stride}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise LadderError(f"--max-tokens must be >= 2 (a token is scored given the ones before it), got {args.max_tokens}")
    reference = None
    if args.reference is not None:
        if stride != args.window:
            raise LadderError("--reference compares over chunked windows: leave out --stride")
        reference = spec.replace(model=args.reference, layout=None, ladder_layers=None, desync_reduce=None,
                                 quantize=None)
        reference.validate()
    request = EvalRequest(spec, args.text, args.window, stride, args.max_tokens, reference)
    result = launch(eval_on_rank, spec.tp, request, device=spec.device).get(0)
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    _write_output(args.output, result)
    if args.json:
        print(json.dumps(result))
    elif reference is not None:
        print(f"perplexity {result['perplexity']:.3f} ({result['model']}, {result['layout']}) against "
              f"{result['reference_perplexity']:.3f} ({result['reference']}, {result['reference_layout']}), "
              f"{result['perplexity'] / result['reference_perplexity'] - 1:+.2%}; greedy next token agrees at "
              f"{result['agreement']:.1%} of {result['n_scored']} positions; mean KL {result['kl']:.4f} nats; "
              f"tp={result['tp']}, windows of {result['window']} tokens of {args.text}")
    else:
        print(f"perplexity {result['perplexity']:.3f} ({result['model']}, {result['layout']}, tp={result['tp']}) over "
              f"{result['n_scored']} tokens of {args.text}; {result['method']}")
    return 0


def _run_tasks(args: argparse.Namespace, spec: ModelSpec) -> int:
    if args.reference or args.max_tokens or args.stride:
        raise LadderError("--reference, --max-tokens and --stride go with --text, not --tasks")
    if args.batch_size < 1:
        raise LadderError(f"--batch-size must be >= 1, got {args.batch_size}")
    for folder in args.include_path:
        if not Path(folder).is_dir():
            raise LadderError(f"--include-path {folder} is not a folder")
    request = TasksRequest(spec, parse_list(args.tasks, str, "--tasks"), args.num_fewshot, args.limit,
                           args.batch_size, args.max_length, list(args.include_path), args.seed)
    result = launch(tasks_on_rank, spec.tp, request, device=spec.device).get(0)
    if result is None:
        return 0
    table = result.pop("table")
    _write_output(args.output, result)
    print(json.dumps(result) if args.json else table)
    return 0


def _write_output(path: str | None, result: dict) -> None:
    if path:
        write_text(Path(path), json.dumps(result, indent=2, default=str) + "\n")


def add_options(e: argparse.ArgumentParser) -> None:
    """`ladder eval`'s options."""
    add_model_options(e)
    e.add_argument("--text", help="a UTF-8 text file: its perplexity")
    e.add_argument("--reference", metavar="MODEL",
                   help="with --text: also score this model (say, the one a ladder model was converted from) and "
                        "give the greedy next-token agreement and the mean KL between the two")
    e.add_argument("--window", type=int, default=512, help="tokens of context per forward")
    e.add_argument("--stride", type=int, help="tokens scored per window (< window: sliding; default: chunked)")
    e.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the file")
    e.add_argument("--tasks", help="comma-separated lm-evaluation-harness tasks (ladder's offline ones: the tag "
                                   "ladder_offline, or ladder_shakespeare_lastword, ...); needs lm-eval installed")
    e.add_argument("--num-fewshot", type=int, help="--tasks: examples in each prompt (default: the task's)")
    e.add_argument("--limit", type=float, help="--tasks: at most this many documents a task (or a fraction)")
    e.add_argument("--batch-size", type=int, default=8, help="--tasks: requests a forward")
    e.add_argument("--max-length", type=int, help="--tasks: context length (default: the model's)")
    e.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="--tasks: a folder of your own task YAMLs (repeatable)")
    e.add_argument("--output", help="also write the result as JSON to this file")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval)
