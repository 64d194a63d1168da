"""A step of the server, as every tensor-parallel rank runs it.

Rank 0 decides each step (`ladder.serve.scheduler`) and sends its `StepPlan` to the other ranks over
the model's process group (`share_plan`); then every rank runs the same forwards on its shard, so the
all-reduces inside them pair up. The plan is small: the token and position of each running request,
the prompt chunks of the requests being prefilled, and the KV-cache rows to move first.

KV-cache rows: the D running requests hold rows 0..D-1 (so the decode forward reads a slice of the
cache, not a gathered copy) and the P requests being prefilled rows D..D+P-1. When a request leaves,
the last running row moves into its place and the prefilling rows move down.

A step runs at most two forwards: one token of every running request, and every prompt chunk at once,
left-padded to the longest. Padding tokens sit at the cache's last position (`scratch_position`), which
no request reads: a request's input positions end at max_model_len - 2 (a prompt and its max_tokens
fit the context, and the last token is never fed back), and a query reads keys up to its own position.

A compiled or CUDA-graphed decode step needs few shapes: `FixedShapeDecode` pads the batch up to a
power of two and reads the cache up to a power-of-two multiple of KV_BLOCK, and makes every shape
(compiles it, or captures its graph) before the server takes requests. The prefill stays eager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ladder.decode_step import DecodeStep
from ladder.engine import CudaGraphStep, compile_step, eager_if
from ladder.model import Transformer
from ladder.packing import weights_for_step

KV_BLOCK = 64  # attention reads the cache up to the longest sequence, rounded up: few distinct shapes


@dataclass
class PrefillChunk:
    row: int
    tokens: list[int]
    start: int  # the position of the first token


@dataclass
class StepPlan:
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (source row, target row, length)
    decode_tokens: list[int] = field(default_factory=list)  # the input token of running row i
    decode_positions: list[int] = field(default_factory=list)  # and its position
    prefill: list[PrefillChunk] = field(default_factory=list)  # in consecutive rows
    stop: bool = False  # the server is shutting down: the ranks leave their loop

    @property
    def computes(self) -> bool:
        return bool(self.decode_tokens or self.prefill)


def share_plan(plan: StepPlan | None, group: dist.ProcessGroup | None, world_size: int) -> StepPlan:
    """Rank 0's plan on every rank (the other ranks pass None), broadcast over the model's process group."""
    if world_size == 1:
        assert plan is not None
        return plan
    box = [plan]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class StepRunner:
    """Runs plans on this rank's shard of the model and returns the logits rank 0 samples from."""

    def __init__(self, model: Transformer, max_batch: int, max_model_len: int,
                 step: DecodeStep = DecodeStep.EAGER) -> None:
        self.model = model
        self.device = model.device
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.step = step
        weights_for_step(model, step)  # oneDNN's packed layout for an eager step on CPU
        model.setup_caches(max_batch, max_model_len)
        self.fixed_shapes = None if step is DecodeStep.EAGER else FixedShapeDecode(model, step, max_batch, max_model_len)

    @property
    def cache_bytes(self) -> int:
        caches = [layer.attention.kv_cache for layer in self.model.layers]
        return sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v))

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(decode logits (D, V), each prefill chunk's last logits (P, V)), None where the plan has none."""
        for source, target, length in plan.moves:
            for layer in self.model.layers:
                layer.attention.kv_cache.move_row(source, target, length)
        decoded = prefilled = None
        if plan.decode_tokens:
            if self.fixed_shapes is not None:
                decoded = self.fixed_shapes(plan.decode_tokens, plan.decode_positions)
            else:
                tokens = torch.tensor(plan.decode_tokens, device=self.device)[:, None]  # (D, 1)
                positions = torch.tensor(plan.decode_positions, device=self.device)[:, None]  # (D, 1): each its own
                kv_len = kv_blocks(max(plan.decode_positions) + 1, self.max_model_len)
                decoded = decode_forward(self.model, tokens, positions, kv_len)
        if plan.prefill:
            prefilled = self._prefill(plan.prefill)
        return decoded, prefilled


    def _prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """The last logits (P, V) of every chunk, in one forward over rows chunks[0].row.., left-padded."""
        longest = max(len(c.tokens) for c in chunks)
        scratch = scratch_position(self.max_model_len)
        tokens = [[0] * (longest - len(c.tokens)) + c.tokens for c in chunks]
        positions = [[scratch] * (longest - len(c.tokens)) + list(range(c.start, c.start + len(c.tokens)))
                     for c in chunks]
        rows = slice(chunks[0].row, chunks[0].row + len(chunks))
        kv_len = kv_blocks(max(c.start + len(c.tokens) for c in chunks), self.max_model_len)
        with eager_if(self.step.compiles_layers):  # a compiled branch per chunk length otherwise
            logits = self.model(torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device),
                                last_only=True, rows=rows, kv_len=kv_len)
        return logits[:, -1]


def scratch_position(max_model_len: int) -> int:
    """The cache position where padding tokens write: no request reads it (see the module's docstring)."""
    return max_model_len - 1


def kv_blocks(needed: int, max_model_len: int) -> int:
    """Cache positions a forward reads: `needed` rounded up to whole blocks."""
    return min(max_model_len, -(-needed // KV_BLOCK) * KV_BLOCK)


def decode_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Logits (B, V) of one token per running request, tokens and positions (B, 1), in cache rows 0..B-1."""
    return model(tokens, positions, rows=slice(0, tokens.shape[0]), kv_len=kv_len)[:, -1]


def powers_of_two_up_to(least: int, most: int) -> list[int]:
    """least, 2 least, 4 least, ... below `most`, then `most`."""
    sizes = [least]
    while sizes[-1] * 2 < most:
        sizes.append(sizes[-1] * 2)
    return [n for n in sizes if n < most] + [most]


class FixedShapeDecode:
    """The server's decode forward at a few shapes, each compiled or captured once (at start-up).

    The batch is padded up to the next of 1, 2, 4, ... max_batch rows, and the cache read up to the next
    of KV_BLOCK, 2 KV_BLOCK, ... max_model_len positions: at most log2(max_batch) + 1 times
    log2(max_model_len / KV_BLOCK) + 1 shapes. A padding row writes its key and value at the scratch
    position, which no request reads, so padding rows may sit on any row, prefilling ones included.
    """

    def __init__(self, model: Transformer, step: DecodeStep, max_batch: int, max_model_len: int) -> None:
        self.device = model.device
        self.scratch_position = scratch_position(max_model_len)
        self.batch_sizes = powers_of_two_up_to(1, max_batch)
        self.kv_lens = powers_of_two_up_to(min(KV_BLOCK, max_model_len), max_model_len)
        forward: Callable[..., torch.Tensor] = functools.partial(decode_forward, model)
        if step.compiles_step:
            forward = compile_step(forward, self.device)
        self.forwards: dict[tuple[int, int], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
        for batch in self.batch_sizes:
            for kv_len in self.kv_lens:
                at_shape = functools.partial(forward, kv_len=kv_len)
                self.forwards[batch, kv_len] = CudaGraphStep(at_shape, model) if step.captures_cuda_graph else at_shape
        if step.compiles_layers:
            model.compile_layers()

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return list(self.forwards)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every shape once, every row a padding row: compiles or captures each, writes only scratch.
        Call it before the first step: the steps after it compile nothing."""
        # torch.compile specialises on each shape, and a fullgraph compile fails past its recompile limit (8).
        with torch._dynamo.config.patch(recompile_limit=max(len(self.forwards), 8)):
            for batch, kv_len in self.forwards:
                self._run([0] * batch, [self.scratch_position] * batch, kv_len)

    def __call__(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits (D, V) of the D running requests."""
        D = len(tokens)
        batch = next(n for n in self.batch_sizes if n >= D)
        kv_len = next(n for n in self.kv_lens if n >= max(positions) + 1)
        pad = batch - D
        return self._run(tokens + [0] * pad, positions + [self.scratch_position] * pad, kv_len)[:D]

    def _run(self, tokens: list[int], positions: list[int], kv_len: int) -> torch.Tensor:
        token_column = torch.tensor(tokens, device=self.device)[:, None]  # (B, 1)
        position_column = torch.tensor(positions, device=self.device)[:, None]
        return self.forwards[len(tokens), kv_len](token_column, position_column)
