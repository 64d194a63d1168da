"""Sampling: every row of a step in one batched call, each row with its own parameters and seed.

Rows are independent: a row's token depends on its logits, its parameters and its own generator only,
so a seeded request gets the same tokens alone or beside others (vLLM's v1 sampler works the same way).
Sampling draws by exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i,
and each row's E comes from that row's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ladder.errors import LadderError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise LadderError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise LadderError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise LadderError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SamplingBatch:
    """The per-row parameters of one step as tensors on the device (made once per set of rows)."""

    temperature: torch.Tensor  # (B,) float; 0 for greedy rows
    top_k: torch.Tensor | None  # (B,) long, the vocabulary size where a row has none; None: no row has one
    top_p: torch.Tensor | None  # (B,) float, 1 where a row has none; None: no row has one
    generators: list[torch.Generator | None]  # a row's own generator (None for a greedy row)
    max_top_k: int | None = None  # the largest of top_k, known on the host (no sync to read it)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           vocab_size: int, device: torch.device) -> SamplingBatch:
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = top_p = max_top_k = None
        if any(p.top_k is not None and not p.greedy for p in params):
            ks = [min(p.top_k or vocab_size, vocab_size) for p in params]
            top_k, max_top_k = torch.tensor(ks, device=device), max(ks)
        if any(p.top_p is not None and p.top_p < 1 and not p.greedy for p in params):
            top_p = torch.tensor([p.top_p or 1.0 for p in params], dtype=torch.float32, device=device)
        rows = [None if p.greedy else g for p, g in zip(params, generators)]
        return cls(temperature, top_k, top_p, rows, max_top_k)

    @property
    def all_greedy(self) -> bool:
        return all(g is None for g in self.generators)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V), every row as its own parameters say."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    # Greedy rows take the argmax below; dividing them by 1 instead of 0 keeps their logits finite.
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits.float() / temperature[:, None]
    if batch.top_p is not None:
        logits = _keep_top_k_top_p(logits, batch.top_k, batch.top_p)
    elif batch.top_k is not None:
        logits = _keep_top_k(logits, batch.top_k, batch.max_top_k or logits.shape[-1])
    probs = logits.softmax(dim=-1)
    race = torch.ones_like(probs)
    for row, generator in enumerate(batch.generators):
        if generator is not None:
            race[row].exponential_(generator=generator)
    sampled = (probs / race).argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, greedy)


def _keep_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Logits with -inf below each row's k-th best (ties with it stay), as `_keep_top_k_top_p` masks
    them: the k-th best from a top-k of the largest k, not a sort of the vocabulary (a 128k-wide
    sort is 4 radix passes on a GPU, 12 ms on this CPU; top-200 of it 0.3 ms)."""
    best = logits.topk(max_top_k, dim=-1).values  # (B, max_top_k), descending
    kth_best = best.gather(-1, (top_k - 1)[:, None])  # (B, 1)
    return logits.masked_fill(logits < kth_best, float("-inf"))


def _keep_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Logits with -inf outside each row's k best and outside its nucleus: the smallest set of best tokens
    whose probability reaches top_p (a token goes when the tokens ranked above it reach top_p already;
    the best always stays). One sort serves both."""
    ascending, order = logits.sort(dim=-1)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth_best = ascending.gather(-1, (vocab - top_k).clamp(0, vocab - 1)[:, None])  # (B, 1)
        ascending = ascending.masked_fill(ascending < kth_best, float("-inf"))
    if top_p is not None:
        below = ascending.softmax(dim=-1).cumsum(dim=-1)  # probability of this token and every worse one
        drop = below <= 1 - top_p[:, None]
        drop[:, -1] = False
        ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(ascending).scatter_(-1, order, ascending)


def row_generators(seed: int, rows: int, device: torch.device) -> list[torch.Generator]:
    """Row i's generator seeded with seed + i: row 0 of a batch samples what a request alone with that
    seed samples (`ladder generate` and the server agree)."""
    return [torch.Generator(device=device).manual_seed(seed + i) for i in range(rows)]
