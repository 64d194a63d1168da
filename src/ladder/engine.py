"""The generation engine: static KV cache, prefill, token-by-token decode, sampling.

It knows token ids, not text; tokenizers and chat templates live at the edges (CLI, server).
Under tensor parallelism every rank runs the same engine with the same seed: logits are identical
on every rank after the final all-reduce, so every rank samples the same token without a broadcast.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ladder.comm.emulated import trace_emulated_launches
from ladder.decode_step import DecodeStep
from ladder.errors import LadderError
from ladder.limits import check_context, check_token_ids
from ladder.model import Transformer
from ladder.packing import weights_for_step
from ladder.sampling import SamplingBatch, SamplingParams, row_generators, sample

TokenCallback = Callable[[torch.Tensor], None]
"""Called with each new token column (B,) as soon as it is sampled (for streaming)."""


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence (stopped sequences end at their stop token)
    prefill_s: float
    decode_s: float
    token_latencies_s: list[float] = field(default_factory=list)  # one per decode step

    @property
    def n_generated(self) -> int:
        return max((len(t) for t in self.tokens), default=0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Runs a `Transformer` for generation, its decode step run as `step` says (`DecodeStep`):
    - eager;
    - compiled: the whole step one graph (with CUDA graphs on CUDA: mode="reduce-overhead"); compiling
      takes longer the more layers the model has;
    - compiled layers: each layer's branches compiled, one graph shared by every layer
      (`Transformer.compile_layers`, in place), the step between them eager; the prefill stays eager;
    - CUDA graph: the step, eager or with compiled layers, captured as one CUDA graph (`CudaGraphStep`).
    """

    def __init__(self, model: Transformer, step: DecodeStep = DecodeStep.EAGER) -> None:
        self.model = model.eval()
        self.device = model.device
        self.step = step
        weights_for_step(model, step)  # oneDNN's packed layout for an eager step on CPU
        self._decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._decode_step
        if step.captures_cuda_graph:
            self._decode = CudaGraphStep(self._decode_step, model)  # (first: it refuses a model off CUDA)
        if step.compiles_layers:
            model.compile_layers()
        if step.compiles_step:
            self._decode = compile_step(self._decode_step, self.device)

    def _decode_step(self, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.model(token, input_pos)[:, -1]  # (B, V)

    def decode(self, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One decode step's logits (B, V) for `token` (B, 1) at cache position `input_pos` (1,), run as
        this engine runs it (eager, compiled or graphed; with CUDA graphs, overwritten by the next step)."""
        return self._decode(token, input_pos)

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int,
                 sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
                 on_token: TokenCallback | None = None, max_seq: int | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` for each row of `prompt` (B, T): equal-length prompts."""
        generation = self.start(prompt, max_new_tokens, sampling, stop_ids, on_token, max_seq)
        while not generation.finished:
            generation.step()
        return generation.result()

    @torch.inference_mode()
    def start(self, prompt: torch.Tensor, max_new_tokens: int,
              sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
              on_token: TokenCallback | None = None, max_seq: int | None = None) -> Generation:
        """A generation that runs when stepped (`Generation.step`); `generate` steps it to the end."""
        if prompt.dim() != 2 or prompt.shape[1] == 0:
            raise LadderError("prompt must be a non-empty (batch, length) tensor of token ids")
        if max_new_tokens < 1:
            raise LadderError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_token_ids((int(prompt.min()), int(prompt.max())), self.model.config.vocab_size, "prompt token id")
        B, T = prompt.shape
        max_seq = max_seq or T + max_new_tokens
        check_context(T, max_new_tokens, self.model.config.max_seq_len)
        check_context(T, max_new_tokens, max_seq, "the KV cache of {limit} tokens")
        self.model.setup_caches(B, max_seq)
        return Generation(self, prompt.to(self.device), max_new_tokens, sampling, stop_ids, on_token)


def compile_step(step: Callable[..., torch.Tensor], device: torch.device) -> Callable[..., torch.Tensor]:
    """`step` as one torch.compile graph (collectives, real or emulated, trace into it), as in the paper,
    with CUDA graphs on CUDA (mode="reduce-overhead"). reorder_for_locality would move each all-reduce
    launch down to its wait, and the overlap with it."""
    options = {"triton.cudagraphs": device.type == "cuda", "reorder_for_locality": False}
    trace_emulated_launches()
    return torch.compile(step, fullgraph=True, options=options)


class CudaGraphStep:
    """The decode step (eager, or with compiled layers) captured once as a CUDA graph, then replayed: one
    launch a step instead of one per kernel. Eager, a 70B shard's 80 layers are ready after one step,
    where compiling the whole step takes minutes per layout. Captured again when the batch or the KV
    cache changes."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: Transformer) -> None:
        device = model.device
        if device.type != "cuda":
            raise LadderError(f"CUDA graphs need a CUDA device; the model is on {device}")
        self.step, self.model = step, model
        self.key: tuple | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        key = (tuple(token.shape), tuple(input_pos.shape), self.model.max_batch, self.model.max_seq,
               id(self.model.layers[0].attention.kv_cache))
        if key != self.key:
            self._capture(token, input_pos)
            self.key = key
        self.token.copy_(token)
        self.input_pos.copy_(input_pos)
        self.graph.replay()
        return self.logits  # overwritten by the next replay: sample from it first

    def _capture(self, token: torch.Tensor, input_pos: torch.Tensor) -> None:
        self.graph = None  # the previous graph's memory goes back first
        self.token, self.input_pos = token.clone(), input_pos.clone()
        # One step outside the capture makes cuBLAS's handles and workspaces. It writes this position's
        # keys and values, the same ones the replay below writes.
        side = torch.cuda.Stream(token.device)
        side.wait_stream(torch.cuda.current_stream(token.device))
        with torch.cuda.stream(side):
            self.step(self.token, self.input_pos)
        torch.cuda.current_stream(token.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.step(self.token, self.input_pos)
        self.graph = graph


class Generation:
    """One generation, advanced one step at a time: the prefill, then one decode step per new token.

    `Engine.generate` steps one to the end. A benchmark can step several, one per model, in turns,
    so that a machine whose speed drifts slows them alike; each keeps the time of its own steps. Two
    generations of one model cannot take turns: they would share its KV cache.
    """

    def __init__(self, engine: Engine, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                 stop_ids: Sequence[int], on_token: TokenCallback | None) -> None:
        self.engine, self.prompt, self.max_new_tokens = engine, prompt, max_new_tokens
        self.sampling, self.stop_ids, self.on_token = sampling, stop_ids, on_token
        rows = prompt.shape[0]
        self.sampling_rows = SamplingBatch.of([sampling] * rows, row_generators(sampling.seed, rows, engine.device),
                                              engine.model.config.vocab_size, engine.device)
        self.stop = torch.tensor(list(stop_ids), dtype=torch.long, device=engine.device)
        self.out: list[torch.Tensor] = []  # the sampled token columns (B,)
        self.done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=engine.device)
        self.finished = False
        self.prefill_s = 0.0
        self.decode_s = 0.0  # the decode steps' own time, bookkeeping and callbacks included
        self.latencies: list[float] = []  # per decode step: the model and sampling, synchronised

    @torch.inference_mode()
    def step(self) -> None:
        """Run the next step (the prefill first), synchronised: its time is its own."""
        if self.finished:
            raise RuntimeError("this generation is finished")
        device, model, (B, T) = self.engine.device, self.engine.model, self.prompt.shape
        synchronize(device)
        start = time.perf_counter()
        if not self.out:
            with eager_if(self.engine.step.compiles_layers):  # (one compilation per prompt length otherwise)
                logits = model(self.prompt, torch.arange(T, device=device), last_only=True)[:, -1]  # (B, V)
            token = sample(logits, self.sampling_rows)  # (B,)
            synchronize(device)
            self.prefill_s = time.perf_counter() - start
        else:
            input_pos = torch.tensor([T + len(self.out) - 1], device=device)
            logits = self.engine.decode(self.out[-1].view(B, 1).clone(), input_pos)
            token = sample(logits, self.sampling_rows)
            token = torch.where(self.done, self.out[-1], token)  # finished rows repeat their stop token
            synchronize(device)
            self.latencies.append(time.perf_counter() - start)
        self.out.append(token)
        self.done |= torch.isin(token, self.stop)
        if self.on_token:
            self.on_token(token)
        self.finished = len(self.out) == self.max_new_tokens or bool(self.done.all())
        if len(self.out) > 1:
            self.decode_s += time.perf_counter() - start

    def result(self) -> GenerationResult:
        return GenerationResult(_trim(torch.stack(self.out, dim=1), self.stop_ids), self.prefill_s,
                                self.decode_s, self.latencies)


def eager_if(condition: bool) -> contextlib.AbstractContextManager:
    """Compiled code runs eagerly inside, when `condition` holds."""
    return torch.compiler.set_stance("force_eager") if condition else contextlib.nullcontext()


def _trim(tokens: torch.Tensor, stop_ids: Sequence[int]) -> list[list[int]]:
    """Cut each row after its first stop token (kept)."""
    rows = []
    for row in tokens.tolist():
        for i, t in enumerate(row):
            if t in stop_ids:
                row = row[: i + 1]
                break
        rows.append(row)
    return rows
