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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from ladder.cpu.linears import Packs, linear_forms
from ladder.errors import LadderError
from ladder.model.config import cpu_computes_in_bf16, cpu_has_amx
from ladder.model.transformer import HALF_PRECISION, Transformer
from ladder.options import DecodeStep, RuntimeOptions
from ladder.runtime.compile import (compile_layers, compile_step, saved_layer_steps, saves_layer_steps, use_compile_cache,
                                    uses_gemm_templates)
from ladder.runtime.cuda_graph import CudaGraphStep
from ladder.runtime.limits import check_context, check_token_ids
from ladder.runtime.sampling import SamplingBatch, SamplingParams, row_generators, sample
from ladder.runtime.step_clock import Lap, StepClock, to_device

TokenCallback = Callable[[torch.Tensor], None]
"""Called with each new token column (B,) as soon as it is sampled (for streaming)."""

KV_BLOCK = 64  # an eager step reads the cache up to the longest sequence, rounded up to this many positions
PREFILL_BLOCK = 32
"""A server forward's tokens come in multiples of this many, as near as its prompt chunks' left padding
can make them. Each new forward shape leaves native memory behind (oneDNN's primitives, the allocator's
free lists): the soak's resident memory grew 10.7 % over 2,000 requests with chunks of every length, and
17.0 % with chunks padded alone beside the running rows' tokens; 5.8 % so (experiments/soak.py
--memory-curve, docs/serving.md)."""


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
    """Runs a `Transformer`'s forwards for generation, its decode step run as `options.step` says
    (`DecodeStep`):
    - eager;
    - compiled: the whole step one graph (with CUDA graphs on CUDA: mode="reduce-overhead"); compiling
      takes longer the more layers the model has;
    - compiled layers: each layer's branches compiled, one graph shared by every layer
      (`ladder.runtime.compile.compile_layers`), the step between them eager;
    - CUDA graph: the step, eager or with compiled layers, captured as one CUDA graph (`CudaGraphStep`).
    Everything it decides (the linear layers' forms, the attention, what compiles) is decided here, once,
    from `options` (`RuntimeOptions`; a `DecodeStep` alone: that step with the environment's settings), on views of
    the model that share its weights (`Transformer.view`): `model` itself is left as it was. The prefill
    runs on an eager view (`self.model`), a compiled step on a view of its own that reads the same caches.
    A view's packed layers are copies: drop `model` once the engine is built, and only they remain.
    The module's docstring says how forwards use the cache, and which shapes a step runs at.
    """

    def __init__(self, model: Transformer, options: RuntimeOptions | DecodeStep = DecodeStep.EAGER) -> None:
        options = options if isinstance(options, RuntimeOptions) else RuntimeOptions.from_environment(options)
        self.options, self.step = options, options.step
        self.device = model.device
        step = options.step
        if step.captures_cuda_graph and self.device.type != "cuda":
            raise LadderError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        on_cpu = self.device.type == "cpu"
        # Half precision on a CPU without bf16 arithmetic (AVX2 emulates it) computes in float32
        upcast = on_cpu and model.tok_embeddings.weight.dtype in HALF_PRECISION and not cpu_computes_in_bf16()
        compute_dtype = torch.float32 if upcast else None
        self.model = model.view().eval()  # the prefill's, and an eager step's
        # A compiled CPU step whose weights are not constants of its graph reads the eager view's packed ones
        templates = step.compiles_step and uses_gemm_templates(options, self.device)
        by_handle = on_cpu and (step.compiles_layers or step.compiles_step and not templates)
        packs: Packs = {}
        linear_forms(self.model, pack=on_cpu and (step is DecodeStep.EAGER or by_handle), int8_rows=on_cpu, upcast=upcast,
                     packs=packs)
        # ATen's bf16 attention of one query is slow on AVX-512 BF16 and fast with AMX (`matmul_decode_attention`)
        slow_half = model.tok_embeddings.weight.dtype in HALF_PRECISION and not upcast and not cpu_has_amx()
        # the eager view attends as an eager step does: a compiled CPU engine decodes on it in mixed steps
        eager = options if step is DecodeStep.EAGER else replace(options, step=DecodeStep.EAGER, decode_attention=None)
        self.model.attend_with(eager.decode_attention_on(self.device.type, slow_half), compute_dtype)
        self._step_model = self.model
        if step.compiles_step or step.compiles_layers:
            self._step_model = model.view().eval()  # the eager view's packed weights, or plain ones, torchao's int8
            # torchao's int8 layers as plain int8 rows and scales where the step's weights are constants of its
            # graph (GEMM templates), and in compiled layers that are saved: torch cannot save the guards of a
            # tensor subclass (its guards go through `empty_like` on meta, which torchao's does not implement)
            saved_layers = step.compiles_layers and saves_layer_steps(self._step_model, self.device, options)
            linear_forms(self._step_model, pack=False, int8_rows=False, upcast=upcast,
                         int8_matmul=templates or saved_layers,
                         by_handle=by_handle, packs=packs)
            self._step_model.attend_with(options.decode_attention_on(self.device.type), compute_dtype)
            freeze_parameters(self._step_model)
        self._forward: Callable[..., torch.Tensor] = functools.partial(decode_forward, self._step_model,
                                                                       rows_as_slice=step.compiles_layers)
        if step.compiles_step or step.compiles_layers:
            use_compile_cache()
        if step.compiles_step:
            self._forward = compile_step(decode_forward, self._step_model, self.device, options)
        if step.compiles_layers:
            compile_layers(self._step_model, options.inductor_options,
                           saved_layer_steps(self._step_model, self.device, options))
        self.max_batch = self.max_seq = 0
        self.batch_sizes: list[int] = []
        self.kv_lens: list[int] = []
        self._steps: dict[tuple[int, int], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}

    def reserve(self, max_batch: int, max_seq: int, padded: bool = False) -> None:
        """A KV cache of (at least) `max_batch` rows of `max_seq` positions, and the shapes a compiled or
        graphed decode step runs at: the batch and the whole cache, or powers of two up to them (`padded`)."""
        self.model.setup_caches(max_batch, max_seq)
        if self._step_model is not self.model:
            self._step_model.use_caches_of(self.model)
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
    def warm_up(self, on_shape: Callable[[int, int], None] | None = None) -> None:
        """Run every shape of the decode step once, every row a padding row: compiles or captures each,
        writes only the scratch position. After it, decode steps compile nothing. `on_shape(done, of)`
        after each shape (a progress line). Compiled layers run through the first WARM_UP_LAYERS layers
        only: every layer reuses their graphs (`ladder.runtime.compile.compile_layers`), and the whole depth would
        only compute (SmolLM2's 32 shapes through 30 layers: 4.2-4.7 s on two AVX2 cores, measured by
        experiments/investigations/serve_start.py)."""
        shallow = self.step is DecodeStep.COMPILED_LAYERS  # (a CUDA graph captures what runs: the whole depth)
        # torch.compile specialises on each shape, and a fullgraph compile fails past its recompile limit (8).
        with torch._dynamo.config.patch(recompile_limit=max(len(self.shapes), 8)), \
                first_layers_only(self._step_model, WARM_UP_LAYERS if shallow else None):
            for done, (batch, kv_len) in enumerate(self.shapes, start=1):
                self._step_at(batch, kv_len)(torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                                             torch.full((batch, 1), self.scratch_position, device=self.device))
                if on_shape is not None:
                    on_shape(done, len(self.shapes))

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
        tokens, positions, rows, kv_len = self._chunk_batch(chunks)
        logits = self.model(tokens, positions, last_only=not every_position, rows=rows, kv_len=kv_len)
        return logits if every_position else logits[:, -1]

    @property
    def mixes_in_one_forward(self) -> bool:
        """Whether a step that decodes and prefills runs `decode_and_prefill`, one eager forward, rather than
        `decode` then `prefill`. On a CPU, yes whatever the step: reading each weight once for both beat a
        compiled decode forward before the eager prefill (SmolLM2 fp32, two AVX2 cores, 7 running rows and a
        32-256 token chunk: 3-15 % less with `--compile`, 10-27 % with `--compile-layers`;
        experiments/investigations/mixed_step.py). On CUDA only an eager step: there a compiled or graphed
        step replays one CUDA graph, and the eager forward launches its kernels one by one (not measured)."""
        return self.step is DecodeStep.EAGER or self.device.type == "cpu"

    def decode_and_prefill(self, tokens: Sequence[int], positions: Sequence[int],
                           chunks: Sequence[PrefillChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode(tokens, positions)` and `prefill(chunks)` in one eager forward (`Transformer.forward_mixed`):
        every weight is read once for both, so the running rows wait only for the prompt tokens' compute."""
        D = len(tokens)
        decoding = (slice(0, D), to_device(tokens, self.device)[:, None], to_device(positions, self.device)[:, None],
                    kv_blocks(max(positions) + 1, self.max_seq))
        chunk_tokens, chunk_positions, rows, kv_len = self._chunk_batch(chunks, beside=D)
        logits = self.model.forward_mixed([decoding, (rows, chunk_tokens, chunk_positions, kv_len)])
        return logits[:D], logits[D:]

    def _chunk_batch(self, chunks: Sequence[PrefillChunk],
                     beside: int = 0) -> tuple[torch.Tensor, torch.Tensor, slice, int]:
        """Prompt chunks as a forward's batch (`prefill`): tokens and positions (P, T), left-padded, their
        cache rows, and the cache positions they read. T is the longest chunk padded so that the forward's
        tokens, these P x T and one of each of the `beside` rows that decode in it, come in whole
        PREFILL_BLOCKs, or as near as T can make them (exactly for one chunk): few shapes."""
        P, longest = len(chunks), max(len(c.tokens) for c in chunks)
        longest = min(range(longest, longest + PREFILL_BLOCK), key=lambda n: (beside + P * n) % PREFILL_BLOCK)
        tokens = [[0] * (longest - len(c.tokens)) + c.tokens for c in chunks]
        positions = [[self.scratch_position] * (longest - len(c.tokens)) + list(range(c.start, c.start + len(c.tokens)))
                     for c in chunks]
        needed = max(c.start + len(c.tokens) for c in chunks)
        return (to_device(tokens, self.device), to_device(positions, self.device),
                slice(chunks[0].row, chunks[0].row + len(chunks)), kv_blocks(needed, self.max_seq))

    def prefill_prompts(self, prompts: torch.Tensor) -> torch.Tensor:
        """The last logits (B, V) of equal-length prompts (B, T), written from position 0 of rows 0..B-1."""
        B, T = prompts.shape
        positions = torch.arange(T, device=self.device).expand(B, T)
        return self.model(prompts, positions, last_only=True, rows=slice(0, B), kv_len=kv_blocks(T, self.max_seq))[:, -1]

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy a sequence's first `length` cache positions to another row, in every layer."""
        for layer in self.model.layers:
            layer.attention.kv_cache.move_row(source, target, length)

    def _step_at(self, batch: int, kv_len: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The decode step at one shape, made on first use (a CUDA graph captures at its first call)."""
        if (batch, kv_len) not in self._steps:
            at_shape = functools.partial(self._forward, kv_len=kv_len)
            self._steps[batch, kv_len] = CudaGraphStep(at_shape, self._step_model) if self.step.captures_cuda_graph else at_shape
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


def freeze_parameters(view: Transformer) -> None:
    """Give a view parameters of its own that share the model's storage but do not require grad: a compiled
    step that takes weights requiring grad as inputs ran AOTAutograd's training graph even in inference mode
    (a copy of each layer's KV cache a step; SmolLM2's bf16 step at batch 8 took 68 ms, frozen 33)."""
    frozen: dict[int, torch.nn.Parameter] = {}
    for module in view.modules():
        for name, p in module._parameters.items():
            if p is not None and p.requires_grad:
                module._parameters[name] = frozen.setdefault(id(p), torch.nn.Parameter(p.detach(), requires_grad=False))


def decode_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                   rows_as_slice: bool = False) -> torch.Tensor:
    """Logits (B, V) of one token a sequence, tokens and positions (B, 1), in cache rows 0..B-1: named as a
    slice where `rows_as_slice` (compiled layers: a constant, so each batch size's attention graph stays
    static; with a symbolic batch, SmolLM2's step at batch 4-8 was 2-15 % slower on AVX2), else as None (a
    compiled step: a slice would keep each layer's region from reusing the first layer's trace)."""
    return model(tokens, positions, rows=slice(0, tokens.shape[0]) if rows_as_slice else None, kv_len=kv_len)[:, -1]


WARM_UP_LAYERS = 2
"""Layers a warm-up of compiled layers runs. Every layer calls the same graphs (the stream plus zeros or plus
an all-reduced output: one graph), so one layer made them all in the tests of each layout; the second reads
what the first's all-reduce gave, as every later layer does."""


@contextlib.contextmanager
def first_layers_only(model: Transformer, n_layers: int | None) -> Iterator[None]:
    """`model` (an engine's own view) as its first `n_layers` layers while the block runs; all of them if None."""
    if n_layers is None or n_layers >= model.config.n_layers:
        yield
        return
    layers, config = model.layers, model.config
    ladder_layers = None if config.ladder_layers is None else min(config.ladder_layers, n_layers)
    model.layers, model.config = layers[:n_layers], config.replace(n_layers=n_layers, ladder_layers=ladder_layers)
    try:
        yield
    finally:
        model.layers, model.config = layers, config


def kv_blocks(needed: int, max_seq: int) -> int:
    """Cache positions an eager forward reads: `needed` rounded up to whole blocks."""
    return min(max_seq, -(-needed // KV_BLOCK) * KV_BLOCK)


def compiled_cache_length(needed: int, limit: int) -> int:
    """The KV cache a compiled step of one generation is made for: `needed` positions rounded up to a power
    of two (at least KV_BLOCK), at most `limit`. The step's shape is the cache's, so the next prompt of
    another length reads the compiled step from torch's cache instead of compiling its own."""
    return min(limit, max(KV_BLOCK, 1 << (needed - 1).bit_length()))


def powers_of_two_up_to(least: int, most: int) -> list[int]:
    """least, 2 least, 4 least, ... below `most`, then `most`."""
    sizes = [least]
    while sizes[-1] * 2 < most:
        sizes.append(sizes[-1] * 2)
    return [n for n in sizes if n < most] + [most]


class Generation:
    """One generation, advanced one step at a time: the prefill, then one decode step per new token.

    `Engine.generate` steps one to the end. A benchmark can step several, one per model, in turns,
    so that a machine whose speed drifts slows them alike; they share one `StepClock`, so that each
    times its own steps. Two generations of one engine cannot take turns: they would share its KV cache.
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
