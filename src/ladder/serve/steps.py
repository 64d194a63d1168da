"""A step of the server, as every tensor-parallel rank runs it on its engine (`ladder.runtime.engine`).

Rank 0 decides each step (`ladder.serve.scheduler`) and sends its `StepPlan` to the other ranks over
the model's process group (`share_plan`); then every rank runs the same forwards on its shard, so the
all-reduces inside them pair up. The plan is small: the token and position of each running request,
the prompt chunks of the requests being prefilled, and the KV-cache rows to move first.

KV-cache rows: the D running requests hold rows 0..D-1 (so the decode forward reads a slice of the
cache, not a gathered copy) and the P requests being prefilled rows D..D+P-1. When a request leaves,
the last running row moves into its place and the prefilling rows move down.

A step that decodes and prefills runs one forward: one token of every running request and every
prompt chunk together (`Engine.decode_and_prefill`), so the running requests wait for the chunks'
compute but not for a second read of the weights (SmolLM2, fp32, two cores, 7 running rows and a
128-token chunk: 208 ms against 248; experiments/investigations/mixed_step.py). On a CPU it is the
eager forward even where the decode step is compiled (`Engine.mixes_in_one_forward`). It runs two
forwards (`Engine.decode`, then `Engine.prefill`) when the decode step is graphed or compiled on CUDA,
or when a chunk asks for every position's logits (a request that wants its prompt's log-probabilities).
The engine's shapes are reserved padded (`Engine.reserve(..., padded=True)`): a compiled or graphed step
is made for each at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ladder.runtime.engine import Engine, PrefillChunk


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


@dataclass
class StepLogits:
    """What a step's forwards give the scheduler; None where the plan has none."""
    decoded: torch.Tensor | None = None  # (D, V): the next-token logits of running row i
    prefilled: torch.Tensor | None = None  # (P, V): each prefill chunk's last logits
    every_position: torch.Tensor | None = None  # (P, T, V): every position's, left-padded, when a chunk asks


@torch.inference_mode()
def run_plan(engine: Engine, plan: StepPlan) -> StepLogits:
    for source, target, length in plan.moves:
        engine.move_row(source, target, length)
    out = StepLogits()
    every_position = any(chunk.every_position for chunk in plan.prefill)
    if plan.decode_tokens and plan.prefill and engine.mixes_in_one_forward and not every_position:
        out.decoded, out.prefilled = engine.decode_and_prefill(plan.decode_tokens, plan.decode_positions, plan.prefill)
        return out
    if plan.decode_tokens:
        out.decoded = engine.decode(plan.decode_tokens, plan.decode_positions)
    if every_position:
        out.every_position = engine.prefill(plan.prefill, every_position=True)
        out.prefilled = out.every_position[:, -1]
    elif plan.prefill:
        out.prefilled = engine.prefill(plan.prefill)
    return out
