"""The engine: one for `ladder generate`, `ladder bench` and `ladder serve`. Static KV cache, prefill,
decode steps (eager, compiled or CUDA-graphed), and `Generation` on top for a batch of prompts.

It knows token ids, not text; tokenizers and chat templates live at the edges (CLI, server).
Under tensor parallelism every rank runs the same engine with the same seed: logits are identical
on every rank after the final all-reduce, so every rank samples the same token without a broadcast.

The KV cache holds `max_batch` rows of `max_seq` positions (`Engine.reserve`). Every forward says, for
each of its rows, which cache row it is and at which positions it writes; a query reads the keys up to
its own position. Two forwards:
- `prefill`: prompt chunks, one a row, left-padded to the longest (in whole PREFILL_BLOCKs: few shapes).
  Padding tokens write at the cache's last position (the scratch position), which no sequence reads:
  input positions end at max_seq - 2 (a prompt and its new tokens fit the cache, and the last new token
  is never fed back).
- `decode`: one token for each of the first D rows, each at its own position.

A compiled or CUDA-graphed decode step runs at a few shapes, each made once: the batch padded up to the
next of `batch_sizes` (padding rows write at the scratch position too), the cache read up to the next
of `kv_lens`. `ladder generate` and `ladder bench` reserve one shape, their batch over the whole cache
(as gpt-fast); the server reserves powers of two (`padded=True`), since its batch and lengths vary, and
makes them all before it takes requests (`warm_up`). An eager step reads the cache up to the longest
sequence rounded up to KV_BLOCK positions, at any batch.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ladder.comm.emulated import trace_emulated_launches
from ladder.runtime.decode_step import DECODE_ATTENTION_VARIABLE, DecodeStep, inductor_options
from ladder.errors import LadderError
from ladder.cpu.inductor_fix import keep_mutation_renames
from ladder.runtime.limits import check_context, check_token_ids
from ladder.model.transformer import Transformer
from ladder.cpu.linears import weights_for_step
from ladder.runtime.sampling import SamplingBatch, SamplingParams, row_generators, sample
from ladder.runtime.step_clock import Lap, StepClock, to_device

TokenCallback = Callable[[torch.Tensor], None]
"""Called with each new token column (B,) as soon as it is sampled (for streaming)."""

KV_BLOCK = 64  # an eager step reads the cache up to the longest sequence, rounded up to this many positions
PREFILL_BLOCK = 32
"""A server prefill's chunks are left-padded to a multiple of this many tokens. Each new forward shape
leaves native memory behind (oneDNN's primitives, the allocator's free lists): with chunks of every
length up to the token budget, the server's resident memory grew 10.7 % over 2,000 soak requests;
padded to 32, 1.0 % (experiments/soak.py --memory-curve, docs/serving.md)."""


@dataclass
class PrefillChunk:
    row: int  # the KV-cache row
    tokens: list[int]
    start: int  # the position of the first token
    every_position: bool = False  # the logits of every position are wanted (prompt log-probabilities)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence (stopped sequences end at their stop token)
    prefill_s: float
    decode_s: float
    token_latencies_s: list[float] = field(default_factory=list)  # one per decode step

    @property
    def n_generated(self) -> int:
        return max((len(t) for t in self.tokens), default=0)


class Engine:
    """Runs a `Transformer`'s forwards for generation, its decode step run as `step` says (`DecodeStep`):
    - eager;
    - compiled: the whole step one graph (with CUDA graphs on CUDA: mode="reduce-overhead"); compiling
      takes longer the more layers the model has;
    - compiled layers: each layer's branches compiled, one graph shared by every layer
      (`Transformer.compile_layers`, in place), the step between them eager; the prefill stays eager;
    - CUDA graph: the step, eager or with compiled layers, captured as one CUDA graph (`CudaGraphStep`).
    The module's docstring says how forwards use the cache, and which shapes a step runs at.
    """

    def __init__(self, model: Transformer, step: DecodeStep = DecodeStep.EAGER) -> None:
        self.model = model.eval()
        self.device = model.device
        self.step = step
        if step.captures_cuda_graph and self.device.type != "cuda":
            raise LadderError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        weights_for_step(model, step)  # oneDNN's packed layout for an eager step on CPU
        if kernel := os.environ.get(DECODE_ATTENTION_VARIABLE):
            check_decode_attention(kernel, step, self.device)
            model.use_decode_attention(kernel)
        self._forward: Callable[..., torch.Tensor] = functools.partial(decode_forward, model)
        if step.compiles_step:
            self._forward = compile_step(self._forward, self.device)
        if step.compiles_layers:
            model.compile_layers()
        self.max_batch = self.max_seq = 0
        self.batch_sizes: list[int] = []
        self.kv_lens: list[int] = []
        self._steps: dict[tuple[int, int], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}

    def reserve(self, max_batch: int, max_seq: int, padded: bool = False) -> None:
        """A KV cache of (at least) `max_batch` rows of `max_seq` positions, and the shapes a compiled or
        graphed decode step runs at: the batch and the whole cache, or powers of two up to them (`padded`)."""
        self.model.setup_caches(max_batch, max_seq)
        self.max_batch, self.max_seq = max_batch, max_seq
        self.batch_sizes = powers_of_two_up_to(1, max_batch) if padded else [max_batch]
        self.kv_lens = powers_of_two_up_to(min(KV_BLOCK, max_seq), max_seq) if padded else [max_seq]

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (batch, cache positions) shapes a compiled or graphed decode step runs at; none if eager."""
        if self.step is DecodeStep.EAGER:
            return []
        return [(batch, kv_len) for batch in self.batch_sizes for kv_len in self.kv_lens]

    @property
    def scratch_position(self) -> int:
        """The cache position where padding tokens write: no sequence reads it (see the module's docstring)."""
        return self.max_seq - 1

    @property
    def cache_bytes(self) -> int:
        caches = [layer.attention.kv_cache for layer in self.model.layers]
        return sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every shape of the decode step once, every row a padding row: compiles or captures each,
        writes only the scratch position. After it, decode steps compile nothing."""
        # torch.compile specialises on each shape, and a fullgraph compile fails past its recompile limit (8).
        with torch._dynamo.config.patch(recompile_limit=max(len(self.shapes), 8)):
            for batch, kv_len in self.shapes:
                self._step_at(batch, kv_len)(torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                                             torch.full((batch, 1), self.scratch_position, device=self.device))

    def decode(self, tokens: torch.Tensor | Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits (D, V) of one step of the sequences in cache rows 0..D-1: `tokens` (D,), each at its own
        position. With CUDA graphs, overwritten by the next step: sample from them first."""
        tokens = tokens.to(self.device) if isinstance(tokens, torch.Tensor) else to_device(tokens, self.device)
        tokens = tokens.view(-1, 1)  # (D, 1)
        D, longest = tokens.shape[0], max(positions) + 1
        if self.step is DecodeStep.EAGER:
            return self._forward(tokens, to_device(positions, self.device)[:, None],
                                 kv_len=kv_blocks(longest, self.max_seq))
        batch = next(n for n in self.batch_sizes if n >= D)
        kv_len = next(n for n in self.kv_lens if n >= longest)
        if batch > D:
            tokens = torch.cat([tokens, tokens.new_zeros(batch - D, 1)])
            positions = [*positions, *[self.scratch_position] * (batch - D)]
        return self._step_at(batch, kv_len)(tokens, to_device(positions, self.device)[:, None])[:D]

    def prefill(self, chunks: Sequence[PrefillChunk], every_position: bool = False) -> torch.Tensor:
        """The last logits (P, V) of every chunk, in one forward over consecutive rows from chunks[0].row,
        left-padded to the longest chunk, rounded up to whole PREFILL_BLOCKs. `every_position`: the logits
        of every position (P, T, V) instead, each chunk's at the right end of its row."""
        longest = -(-max(len(c.tokens) for c in chunks) // PREFILL_BLOCK) * PREFILL_BLOCK
        tokens = [[0] * (longest - len(c.tokens)) + c.tokens for c in chunks]
        positions = [[self.scratch_position] * (longest - len(c.tokens)) + list(range(c.start, c.start + len(c.tokens)))
                     for c in chunks]
        rows = slice(chunks[0].row, chunks[0].row + len(chunks))
        return self._prefill(to_device(tokens, self.device), to_device(positions, self.device),
                             rows, max(c.start + len(c.tokens) for c in chunks), every_position)

    def prefill_prompts(self, prompts: torch.Tensor) -> torch.Tensor:
        """The last logits (B, V) of equal-length prompts (B, T), written from position 0 of rows 0..B-1."""
        B, T = prompts.shape
        positions = torch.arange(T, device=self.device).expand(B, T)
        return self._prefill(prompts, positions, slice(0, B), T)

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy a sequence's first `length` cache positions to another row, in every layer."""
        for layer in self.model.layers:
            layer.attention.kv_cache.move_row(source, target, length)

    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, rows: slice, longest: int,
                 every_position: bool = False) -> torch.Tensor:
        with eager_if(self.step.compiles_layers):  # a compiled branch per prompt length otherwise
            logits = self.model(tokens, positions, last_only=not every_position, rows=rows,
                                kv_len=kv_blocks(longest, self.max_seq))
        return logits if every_position else logits[:, -1]

    def _step_at(self, batch: int, kv_len: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The decode step at one shape, made on first use (a CUDA graph captures at its first call)."""
        if (batch, kv_len) not in self._steps:
            at_shape = functools.partial(self._forward, kv_len=kv_len)
            self._steps[batch, kv_len] = CudaGraphStep(at_shape, self.model) if self.step.captures_cuda_graph else at_shape
        return self._steps[batch, kv_len]

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
              on_token: TokenCallback | None = None, max_seq: int | None = None,
              clock: StepClock | None = None) -> Generation:
        """A generation that runs when stepped (`Generation.step`); `generate` steps it to the end.
        `max_seq`: the cache's length (default: the prompt and its new tokens), one shape for many prompts.
        `clock`: shared by generations that take turns on one device (default: the generation's own)."""
        if prompt.dim() != 2 or prompt.shape[1] == 0:
            raise LadderError("prompt must be a non-empty (batch, length) tensor of token ids")
        if max_new_tokens < 1:
            raise LadderError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_token_ids((int(prompt.min()), int(prompt.max())), self.model.config.vocab_size, "prompt token id")
        B, T = prompt.shape
        max_seq = max_seq or T + max_new_tokens
        check_context(T, max_new_tokens, self.model.config.max_seq_len)
        check_context(T, max_new_tokens, max_seq, "the KV cache of {limit} tokens")
        self.reserve(B, max_seq)
        return Generation(self, prompt.to(self.device), max_new_tokens, sampling, stop_ids, on_token, clock)


def decode_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Logits (B, V) of one token a sequence, tokens and positions (B, 1), in cache rows 0..B-1."""
    return model(tokens, positions, rows=slice(0, tokens.shape[0]), kv_len=kv_len)[:, -1]


def kv_blocks(needed: int, max_seq: int) -> int:
    """Cache positions an eager forward reads: `needed` rounded up to whole blocks."""
    return min(max_seq, -(-needed // KV_BLOCK) * KV_BLOCK)


def powers_of_two_up_to(least: int, most: int) -> list[int]:
    """least, 2 least, 4 least, ... below `most`, then `most`."""
    sizes = [least]
    while sizes[-1] * 2 < most:
        sizes.append(sizes[-1] * 2)
    return [n for n in sizes if n < most] + [most]


# A compiled CPU step freezes the weights (constants of the graph) so that inductor can pick its C++ GEMM
# templates: weights repacked once into blocks, the int8 dequantization and scale fused into the GEMM.
# SmolLM2 at batch 1 on an AVX2 CPU (docs/quantization.md): int8 bf16 twice as fast as torch's
# `_weight_int8pack_mm` kernel, fp32 twice as fast as oneDNN's GEMV. The compile takes longer (each GEMM
# shape's template and ATen kernel are built and timed): LADDER_CPU_GEMM_TEMPLATES=0 keeps inductor's defaults.
# (inductor reads `freezing` outside a compile's options: `_with_frozen_weights` sets it.)
CPU_GEMM_TEMPLATES = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
CPU_GEMM_TEMPLATES_VARIABLE = "LADDER_CPU_GEMM_TEMPLATES"


def check_decode_attention(kernel: str, step: DecodeStep, device: torch.device) -> None:
    """Refuses the one pairing that cannot compile: inductor's CPU FlexAttention takes its mask only from the
    graph's inputs, and a whole compiled step computes the mask inside."""
    if kernel == "flex" and step.compiles_step and device.type == "cpu":
        raise LadderError(f"{DECODE_ATTENTION_VARIABLE}=flex compiles on a CPU with --compile-layers, not --compile")


def compile_step(step: Callable[..., torch.Tensor], device: torch.device) -> Callable[..., torch.Tensor]:
    """`step` as one torch.compile graph (collectives, real or emulated, trace into it), as in the paper,
    with CUDA graphs on CUDA (mode="reduce-overhead"). reorder_for_locality would move each all-reduce
    launch down to its wait, and the overlap with it. Each wait is a custom op that writes its result:
    `keep_mutation_renames` keeps inductor's CPU fusion from reading that result before the wait."""
    templates = device.type == "cpu" and cpu_gemm_templates()
    options = {"triton.cudagraphs": device.type == "cuda", "reorder_for_locality": False,
               **(CPU_GEMM_TEMPLATES if templates else {}), **inductor_options()}
    trace_emulated_launches()
    keep_mutation_renames()
    # Entries of its own (torch.compile shares them among every compile of one function), so that the
    # guards on the model can go: they would be checked each step, and this engine's model never changes.
    compiled = torch.compile(step, fullgraph=True, options={**options, "guard_filter_fn": guards_off_the_model},
                             isolate_recompiles=True)
    return _with_frozen_weights(compiled) if templates else compiled


def cpu_gemm_templates() -> bool:
    """Whether a compiled CPU step freezes its weights for inductor's C++ GEMM templates."""
    return os.environ.get(CPU_GEMM_TEMPLATES_VARIABLE, "1") != "0"


def guards_off_the_model(guards: list[Any]) -> list[bool]:
    """Which of a compiled step's guards to keep: all but those on the model, whose weights, modules and
    settings stay as they are for an engine's life (its compiled step is its own: `isolate_recompiles`),
    except its buffers' shapes (`setup_caches` makes new KV caches). Checking SmolLM2's 6,000 guards
    took 1.8 ms of a 16 ms int8 step on this CPU."""
    return [not guard.orig_guard.source.is_unspecialized_nn_module()
            or (guard.guard_type == "TENSOR_MATCH" and "._buffers[" in guard.name) for guard in guards]


def _with_frozen_weights(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`compiled`, compiling (at its first call, and at each recompile) with the weights frozen: an engine
    serves fixed weights, and the prefill, eager, reads the model's own. Not through inductor's on-disk
    graph cache, so each compile starts cold (SmolLM2 int8: ~140 s; bf16 ~35 s from the cache): it keys
    frozen weights by their shapes, and a hit gave a second model of one shape the first one's weights
    (tests/test_engine.py). With a digest of the weights in its key (tried), each entry still wrote the
    weights the graph packed to disk, once for every shape a step is made at (SmolLM2: 137 MB int8, 271 MB
    bf16 an entry)."""
    import torch._inductor.config as inductor_config

    @functools.wraps(compiled)
    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        with inductor_config.patch(freezing=True, fx_graph_cache=False):
            return compiled(*args, **kwargs)
    return step


class CudaGraphStep:
    """The decode step (eager, or with compiled layers) captured once as a CUDA graph, then replayed: one
    launch a step instead of one per kernel. Eager, a 70B shard's 80 layers are ready after one step,
    where compiling the whole step takes minutes per layout. Captured again when the batch or the KV
    cache changes."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: Transformer) -> None:
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
    so that a machine whose speed drifts slows them alike; they share one `StepClock`, so that each
    times its own steps. Two generations of one model cannot take turns: they would share its KV cache.
    A step does not wait for the device (unless a stop id or `on_token` needs the tokens on the host):
    on a GPU the next step is queued while this one runs, and the times are read at the end.
    """

    def __init__(self, engine: Engine, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
                 stop_ids: Sequence[int], on_token: TokenCallback | None, clock: StepClock | None = None) -> None:
        self.engine, self.prompt, self.max_new_tokens = engine, prompt, max_new_tokens
        self.sampling, self.stop_ids, self.on_token = sampling, stop_ids, on_token
        self.clock = clock or StepClock(engine.device)
        rows = prompt.shape[0]
        self.sampling_rows = SamplingBatch.of([sampling] * rows, row_generators(sampling.seed, rows, engine.device),
                                              engine.model.config.vocab_size, engine.device)
        self.stop = torch.tensor(list(stop_ids), dtype=torch.long, device=engine.device)
        self.out: list[torch.Tensor] = []  # the sampled token columns (B,)
        self.done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=engine.device)
        self.finished = False
        self.laps: list[Lap] = []  # the prefill's, then one per decode step: model, sampling, and the
        # host's work since the previous step where the device waited for it

    @torch.inference_mode()
    def step(self) -> None:
        """Queue the next step (the prefill first)."""
        if self.finished:
            raise RuntimeError("this generation is finished")
        if not self.clock.running:
            self.clock.start()
        B, T = self.prompt.shape
        if not self.out:
            token = sample(self.engine.prefill_prompts(self.prompt), self.sampling_rows)  # (B,)
        else:
            token = sample(self.engine.decode(self.out[-1], [T + len(self.out) - 1] * B), self.sampling_rows)
            if self.stop_ids:
                token = torch.where(self.done, self.out[-1], token)  # finished rows repeat their stop token
        self.laps.append(self.clock.lap())
        self.out.append(token)
        if self.on_token:
            self.on_token(token)
        if self.stop_ids:
            self.done |= torch.isin(token, self.stop)
        self.finished = len(self.out) == self.max_new_tokens or (bool(self.stop_ids) and bool(self.done.all()))

    def result(self) -> GenerationResult:
        """The tokens and the steps' times (on a GPU, once every step has run)."""
        seconds = [lap.seconds() for lap in self.laps]
        return GenerationResult(_trim(torch.stack(self.out, dim=1), self.stop_ids), seconds[0], sum(seconds[1:]),
                                seconds[1:])


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
