"""The `ladder` command line: one thin layer over typed functions.

Every user error is a `LadderError`, printed as one line (`ladder: error: ...`) with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ladder.config import DESYNC_PATTERNS, LAYOUTS, PRESETS, ModelConfig, get_preset
from ladder.errors import LadderError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- model selection shared by every subcommand ---------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """Which model to run and how: a preset with random weights (a real checkpoint comes later)."""

    preset: str = "tiny"
    layout: str | None = None
    ladder_layers: int | None = None
    desync_reduce: str | None = None
    tp: int = 1
    device: str = "auto"
    dtype: str | None = None
    shard_vocab: bool = False
    seed: int = 0

    def config(self) -> ModelConfig:
        base = get_preset(self.preset)
        changes: dict[str, object] = {}
        layout = self.layout
        if self.ladder_layers is not None and layout is None:
            layout = "ladder"  # --ladder-layers alone means hybrid ladder
        if layout is not None:
            changes["layout"] = layout
        if self.ladder_layers is not None:
            changes["ladder_layers"] = self.ladder_layers
        if self.desync_reduce is not None:
            changes["desync_reduce"] = self.desync_reduce
        config = base.replace(**changes) if changes else base
        config.check_tp(self.tp)
        return config

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", default="tiny", help=f"model shape, one of: {', '.join(PRESETS)}")
    g.add_argument("--layout", help=f"residual layout, one of: {', '.join(LAYOUTS)} (default: the model's)")
    g.add_argument("--ladder-layers", type=int, metavar="N", help="ladder on the last N layers (hybrid)")
    g.add_argument("--desync-reduce", choices=DESYNC_PATTERNS, help="which modules desync all-reduces")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (starts N local workers)")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    g.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--shard-vocab", action="store_true", help="shard the output head's vocabulary")
    g.add_argument("--seed", type=int, default=0, help="seed for random weights and sampling")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(preset=args.preset, layout=args.layout, ladder_layers=args.ladder_layers,
                     desync_reduce=args.desync_reduce, tp=args.tp, device=args.device, dtype=args.dtype,
                     shard_vocab=args.shard_vocab, seed=args.seed)


# ---- generate -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GenerateRequest:
    model: ModelSpec
    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] = ()
    compile: bool = False


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise LadderError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise LadderError("--prompt-ids is empty")
    return ids


def generate_on_rank(req: GenerateRequest) -> list[list[int]]:
    """One rank's share of `ladder generate` (runs in each worker process)."""
    from ladder.distributed import init_distributed, print_rank0, shutdown_distributed
    from ladder.engine import Engine, SamplingParams
    from ladder.weights import random_model

    ctx = init_distributed(req.model.device)
    try:
        config = req.model.config()
        model = random_model(config, ctx.communicator(), ctx.device, req.model.torch_dtype(ctx.device),
                             seed=req.model.seed, shard_vocab=req.model.shard_vocab)
        engine = Engine(model, compile=req.compile)
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.model.seed)
        prompt = torch.tensor(req.prompts, dtype=torch.long)
        streamed = len(req.prompts) == 1

        def on_token(token: torch.Tensor) -> None:
            if streamed:
                print_rank0(f"{int(token[0])} ", end="")

        if streamed:
            print_rank0("generated: ", end="")
        result = engine.generate(prompt, req.max_new_tokens, sampling, req.stop_ids, on_token)
        if streamed:
            print_rank0()
        else:
            for i, row in enumerate(result.tokens):
                print_rank0(f"generated[{i}]: {' '.join(map(str, row))}")
        n = result.n_generated
        print_rank0(f"({n} tokens: prefill {result.prefill_s * 1e3:.1f} ms, decode {result.decode_s * 1e3:.1f} ms, "
                    f"{len(req.prompts) * max(n - 1, 0) / max(result.decode_s, 1e-9):.1f} tokens/s decode)")
        return result.tokens
    finally:
        shutdown_distributed()


def cmd_generate(args: argparse.Namespace) -> int:
    from ladder.launch import launch

    spec = model_spec(args)
    config = spec.config()
    prompts = [parse_ids(p) for p in (args.prompt_ids or [])]
    if not prompts:
        raise LadderError("give a prompt with --prompt-ids 1,2,3 (repeat the flag for a batch)")
    if len({len(p) for p in prompts}) > 1:
        raise LadderError(f"batched prompts must have equal lengths, got {[len(p) for p in prompts]}")
    total = len(prompts[0]) + args.max_new_tokens
    if total > config.max_seq_len:
        raise LadderError(f"prompt of {len(prompts[0])} tokens + {args.max_new_tokens} new tokens = {total} "
                          f"exceeds the model's max_seq_len {config.max_seq_len}")
    bad = [t for p in prompts for t in p if not 0 <= t < config.vocab_size]
    if bad:
        raise LadderError(f"token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    print(f"ladder: {spec.preset} ({config.n_params() / 1e6:.1f}M params), layout {config.layout_name}, "
          f"tp={spec.tp}. Weights are RANDOM (seed {spec.seed}): the ids are not meaningful text.",
          flush=True)
    req = GenerateRequest(model=spec, prompts=prompts, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          stop_ids=tuple(parse_ids(args.stop_ids)) if args.stop_ids else (),
                          compile=args.compile)
    launch(generate_on_rank, spec.tp, req)
    return 0


# ---- entry point ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladder", description="Ladder-Residual transformers: run, "
                                     "benchmark and convert models with every residual layout.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate token ids (random weights) with any layout and TP degree")
    add_model_options(g)
    g.add_argument("--prompt-ids", action="append", metavar="IDS",
                   help="comma-separated prompt token ids; repeat for a batch of equal-length prompts")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--stop-ids", help="comma-separated ids that end a sequence")
    g.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LadderError as exc:
        print(f"ladder: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ladder: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
