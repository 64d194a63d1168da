"""`ladder generate`: text or token ids from any model, layout and TP degree."""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.cli.common import add_model_options, decode_step, info, model_spec, parse_ids
from ladder.comm.distributed import check_ranks_agree, init_distributed, shutdown_distributed
from ladder.comm.launch import launch
from ladder.console import print_rank0
from ladder.errors import LadderError
from ladder.model.spec import ModelSpec
from ladder.options import CPU_DTYPE, DecodeStep, environment_value
from ladder.runtime.detokenizer import IncrementalDetokenizer
from ladder.runtime.engine import Engine, compiled_cache_length
from ladder.runtime.limits import check_context, check_token_ids
from ladder.runtime.sampling import SamplingParams


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
    decode_step: DecodeStep = DecodeStep.EAGER


def _prompt_tensor(req: GenerateRequest, tokenizer: TextTokenizer | None, vocab: int) -> torch.Tensor:
    if req.prompt_ids is not None:
        check_token_ids((t for p in req.prompt_ids for t in p), vocab)
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


def settings_line(spec: ModelSpec, step: DecodeStep, device: torch.device) -> str:
    """What runs, as picked: the activation dtype (with --quantize, the one its kernels are fast in) and
    the decode step, and the faster step that exists where an eager one was asked for."""
    dtype = spec.dtype_name(device)
    if spec.dtype:
        why = ""
    elif device.type == "cpu" and environment_value(CPU_DTYPE):
        why = f" ({CPU_DTYPE})"
    elif device.type == "cpu" and spec.quantize:
        why = f", the fastest with {spec.quantize} weights on this CPU"
    else:
        why = ", the default here"
    line = f"{dtype} activations{why}; {step.value} decode step"
    if step is DecodeStep.EAGER:
        line += " (--compile decodes faster, after a one-time compile)"
    return line


def compile_before_generating(engine: Engine, batch: int, max_seq: int) -> None:
    """Compile (or capture) the decode step at the generation's shape before the first token, saying so, so
    that the decode rate counts decode steps only and the compile has a line of its own."""
    engine.reserve(batch, max_seq)
    info(f"ladder: compiling the {engine.step.value} decode step (minutes on a CPU the first time, seconds "
         "once torch's cache holds it)...")
    with ticking("ladder: still compiling"):
        start = time.perf_counter()
        engine.warm_up()
    info(f"ladder: compiled in {time.perf_counter() - start:.1f} s")


@contextlib.contextmanager
def ticking(message: str, every_s: float = 15.0) -> Iterator[None]:
    """`message` with the seconds so far, every `every_s` seconds, while the block runs (rank 0, stderr)."""
    done, start = threading.Event(), time.perf_counter()

    def tick() -> None:
        while not done.wait(every_s):
            info(f"{message}, {time.perf_counter() - start:.0f} s")
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def generate_on_rank(req: GenerateRequest) -> list[list[int]]:
    """One rank's share of `ladder generate` (runs in each worker process)."""
    ctx = init_distributed(req.model.device)
    try:
        loaded = req.model.load(ctx.communicator(), ctx.device)
        tokenizer = loaded.tokenizer
        prompt = _prompt_tensor(req, tokenizer, loaded.model.config.vocab_size)
        check_ranks_agree((req, prompt.tolist()), "options or prompt tokens")
        info(f"ladder: {req.model.describe(loaded)}")
        if loaded.random_weights:
            info("ladder: weights are RANDOM: the generated ids are not meaningful text")
        engine = Engine(loaded.model, req.decode_step)
        loaded.model = engine.model  # the engine's view: the weights it packed replace the model's
        info(f"ladder: {settings_line(req.model, req.decode_step, ctx.device)}")
        max_seq = None  # an eager step's cache: the prompt and its new tokens
        if req.decode_step is not DecodeStep.EAGER:
            max_seq = compiled_cache_length(prompt.shape[1] + req.max_new_tokens, loaded.model.config.max_seq_len)
            compile_before_generating(engine, prompt.shape[0], max_seq)
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, req.model.seed)
        text_mode = req.prompt_ids is None
        stop_ids = tuple(req.stop_ids) + (tuple(tokenizer.stop_ids) if text_mode and tokenizer else ())
        batch = prompt.shape[0]
        stream = IncrementalDetokenizer(tokenizer) if text_mode else None

        def on_token(token: torch.Tensor) -> None:
            if stream is not None:
                if int(token[0]) not in stop_ids:
                    print_rank0(stream.push(int(token[0])), end="")
            elif batch == 1:
                print_rank0(f"{int(token[0])} ", end="")

        if not text_mode and batch == 1:
            print_rank0("generated: ", end="")
        result = engine.generate(prompt, req.max_new_tokens, sampling, stop_ids, on_token, max_seq)
        if stream is not None:
            print_rank0(stream.flush())
        elif batch == 1:
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
    spec = model_spec(args)
    config = spec.validate()
    given = [x is not None for x in (args.prompt_ids, args.prompt, args.chat)]
    if sum(given) != 1:
        raise LadderError("give exactly one of --prompt TEXT, --chat TEXT or --prompt-ids 1,2,3")
    if args.max_new_tokens < 1:
        raise LadderError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    step = decode_step(args)
    SamplingParams(args.temperature, args.top_k, args.top_p)  # its checks, before the minutes of loading
    prompts = [parse_ids(p, "--prompt-ids") for p in args.prompt_ids] if args.prompt_ids else None
    if prompts:
        if len({len(p) for p in prompts}) > 1:
            raise LadderError(f"batched prompts must have equal lengths, got {[len(p) for p in prompts]}")
        if config is not None:
            check_context(len(prompts[0]), args.max_new_tokens, config.max_seq_len)
            check_token_ids((t for p in prompts for t in p), config.vocab_size)
    stop_ids = tuple(parse_ids(args.stop_ids, "--stop-ids")) if args.stop_ids else ()
    req = GenerateRequest(model=spec, max_new_tokens=args.max_new_tokens, prompt_ids=prompts, prompt=args.prompt,
                          chat=args.chat, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          stop_ids=stop_ids, decode_step=step)
    launch(generate_on_rank, spec.tp, req, device=spec.device)
    return 0


def add_options(g: argparse.ArgumentParser) -> None:
    """`ladder generate`'s options."""
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
