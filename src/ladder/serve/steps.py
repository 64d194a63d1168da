"""A step of the server, as every tensor-parallel rank runs it.

Rank 0 decides each step (`ladder.serve.scheduler`) and sends its `StepPlan` to the other ranks over
the model's process group (`share_plan`); then every rank runs the same forwards on its shard, so the
all-reduces inside them pair up. The plan is small: the token and position of each running request,
at most one chunk of one prompt, and the KV-cache rows to move first.

KV-cache rows: the D running requests hold rows 0..D-1 (so the decode forward reads a slice of the
cache, not a gathered copy) and the one request being prefilled holds row D. When a request leaves,
the last running row moves into its place, and the prefilling row after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ladder.model import Transformer

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
    prefill: PrefillChunk | None = None
    stop: bool = False  # the server is shutting down: the ranks leave their loop

    @property
    def computes(self) -> bool:
        return bool(self.decode_tokens) or self.prefill is not None


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

    def __init__(self, model: Transformer, max_batch: int, max_model_len: int) -> None:
        self.model = model
        self.device = model.output.weight.device
        self.max_model_len = max_model_len
        model.setup_caches(max_batch, max_model_len)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(decode logits (D, V), the prefill chunk's last logits (V,)), None where the plan has none."""
        for source, target, length in plan.moves:
            for layer in self.model.layers:
                layer.attention.kv_cache.move_row(source, target, length)
        decoded = prefilled = None
        if plan.decode_tokens:
            tokens = torch.tensor(plan.decode_tokens, device=self.device)[:, None]  # (D, 1)
            positions = torch.tensor(plan.decode_positions, device=self.device)[:, None]  # (D, 1): each its own
            rows = slice(0, len(plan.decode_tokens))
            decoded = self.model(tokens, positions, rows=rows, kv_len=self._kv_len(max(plan.decode_positions) + 1))[:, -1]
        if plan.prefill is not None:
            chunk = plan.prefill
            tokens = torch.tensor([chunk.tokens], device=self.device)  # (1, T)
            positions = torch.arange(chunk.start, chunk.start + len(chunk.tokens), device=self.device)
            logits = self.model(tokens, positions, last_only=True, rows=slice(chunk.row, chunk.row + 1),
                                kv_len=self._kv_len(chunk.start + len(chunk.tokens)))
            prefilled = logits[0, -1]
        return decoded, prefilled

    def _kv_len(self, needed: int) -> int:
        return min(self.max_model_len, -(-needed // KV_BLOCK) * KV_BLOCK)
