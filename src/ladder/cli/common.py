"""What every command shares: the model options, list parsing and status lines."""

from __future__ import annotations

import argparse

from ladder.console import is_rank0, say
from ladder.errors import LadderError
from ladder.model.config import DEFAULT_DTYPE_HELP, DESYNC_PATTERNS, DTYPE_BYTES, LAYOUTS, PRESETS
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.quant.quantize import QUANTIZE_MODES

DTYPE_CHOICES = list(DTYPE_BYTES)


def info(message: str) -> None:
    """Status lines go to stderr (rank 0 only), so stdout carries only the answer."""
    if is_rank0():
        say(message)


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
    g.add_argument("--dtype", choices=DTYPE_CHOICES, help=DEFAULT_DTYPE_HELP)
    g.add_argument("--shard-vocab", action="store_true", help="shard the output head's vocabulary")
    g.add_argument("--seed", type=int, default=0, help="seed for random weights and sampling")
    add_quantize_option(g)


def add_quantize_option(g: argparse._ActionsContainer) -> None:
    g.add_argument("--quantize", choices=QUANTIZE_MODES,
                   help="weight-only quantization of each rank's block linears (int8: and the head), through torchao (default: none)")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(preset=args.preset, model=args.model, layout=args.layout, ladder_layers=args.ladder_layers,
                     desync_reduce=args.desync_reduce, tp=getattr(args, "tp", 1), device=args.device,
                     dtype=args.dtype, shard_vocab=args.shard_vocab, seed=args.seed,
                     quantize=args.quantize)


def decode_step(args: argparse.Namespace) -> DecodeStep:
    """`--compile`, `--compile-layers` and `--cuda-graph` (those a command has) as one value, checked once."""
    return DecodeStep.from_flags(getattr(args, "compile", False), getattr(args, "compile_layers", False),
                                 getattr(args, "cuda_graph", False))


def parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise LadderError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise LadderError(f"{flag} is empty")
    return ids


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


