"""Completions of many prompts of different lengths on one engine, a batch at a time: the teacher's
answers that self-distillation trains on (`ladder.train.answers`) and lm-eval's `generate_until`
(`ladder.harness`).

A batch's prompts are prefilled together, each in its own KV-cache row and left-padded as the server's
prompt chunks are (`Engine.prefill`), then decoded one token a row per step, each row at its own
position. Row i of the whole list samples with its own generator, seeded `sampling.seed + i`, so a
prompt's completion does not depend on the batch it lands in or on how the list is split among ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm import tqdm

from ladder.errors import LadderError
from ladder.runtime.engine import Engine, PrefillChunk
from ladder.runtime.limits import check_context
from ladder.runtime.sampling import SamplingBatch, SamplingParams, row_generators, sample


@torch.inference_mode()
def complete(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (), batch_size: int = 16,
             first_index: int = 0, progress: bool = False) -> list[list[int]]:
    """Up to `max_new_tokens` new ids for each prompt, ending at (and keeping) the first of `stop_ids`.
    Prompts are batched longest first, so that a batch's rows pad little; `first_index` is the first
    prompt's index in a longer list (the seed of its generator)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise LadderError("a prompt to complete is empty")
    if max_new_tokens < 1:
        raise LadderError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    check_context(longest, max_new_tokens, engine.model.config.max_seq_len)
    # One cache for every batch: the longest prompt and its new tokens (the last is never fed back, so the
    # last position stays the padding's scratch position: `ladder.runtime.engine`).
    engine.reserve(min(batch_size, len(prompts)), longest + max_new_tokens)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=engine.device)
    for start in tqdm(range(0, len(order), batch_size), desc="complete", unit="batch", disable=not progress,
                      dynamic_ncols=True):
        rows = order[start:start + batch_size]
        batch = [list(prompts[i]) for i in rows]
        generators = [g for i in rows for g in row_generators(sampling.seed + first_index + i, 1, engine.device)]
        rows_sampling = SamplingBatch.of([sampling] * len(rows), generators, engine.model.config.vocab_size,
                                         engine.device)
        for i, new in zip(rows, _complete_batch(engine, batch, max_new_tokens, rows_sampling, stops)):
            out[i] = new
    return out


def _complete_batch(engine: Engine, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingBatch,
                    stops: torch.Tensor) -> list[list[int]]:
    """One batch: prompts in cache rows 0..B-1, prefilled together, then one decode step per new token."""
    token = sample(engine.prefill([PrefillChunk(row, p, 0) for row, p in enumerate(prompts)]), sampling)  # (B,)
    columns = [token]
    done = torch.isin(token, stops)
    lengths = [len(p) for p in prompts]
    for step in range(1, max_new_tokens):
        if bool(done.all()):
            break
        logits = engine.decode(columns[-1], [n + step - 1 for n in lengths])  # each row's newest token
        token = torch.where(done, columns[-1], sample(logits, sampling))  # finished rows repeat their stop
        columns.append(token)
        done |= torch.isin(token, stops)
    stop_set = set(stops.tolist())
    rows = []
    for row in torch.stack(columns, dim=1).tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))
        rows.append(row[:end])
    return rows
