"""`ladder eval`: perplexity of a model on a text file, at any layout and TP degree."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladder.cli.common import add_model_options, info, model_spec
from ladder.comm.distributed import check_ranks_agree, fingerprint, init_distributed, shutdown_distributed
from ladder.comm.launch import launch
from ladder.errors import LadderError
from ladder.evaluate import perplexity
from ladder.spec import ModelSpec


@dataclass(frozen=True)
class EvalRequest:
    model: ModelSpec
    text_file: str
    window: int
    stride: int
    max_tokens: int | None


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
        result = perplexity(loaded.model, ids, req.window, req.stride, progress=ctx.is_main)
        result.update(model=req.model.label, text=req.text_file, layout=loaded.model.config.layout_name,
                      ladder_layers=loaded.model.config.n_ladder_layers, tp=ctx.world_size)
        return result
    finally:
        shutdown_distributed()


def cmd_eval(args: argparse.Namespace) -> int:
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


def add_parser(sub: Any) -> argparse.ArgumentParser:
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
