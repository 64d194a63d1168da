"""Perplexity of a token sequence, by chunked or sliding windows (stated in the result)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ladder.errors import LadderError
from ladder.model.transformer import Transformer


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each forward: every token but the first is scored exactly
    once, each with at least one token of context. A forward reads at most `window` tokens and scores
    up to `stride` (at most window - 1) new ones; a smaller stride gives each token more context."""
    stride = min(stride, window - 1)
    spans, scored_to = [], 1
    while scored_to < n_tokens:
        end = min(scored_to + stride, n_tokens)
        spans.append((max(0, end - window), end, scored_to))
        scored_to = end
    return spans


@torch.inference_mode()
def perplexity(model: Transformer, ids: list[int], window: int = 512, stride: int | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Token-level perplexity exp(mean NLL) of `ids` under `model` (natural log)."""
    stride = min(stride or window, window - 1)
    if window < 2:
        raise LadderError(f"--window must be at least 2 tokens, got {window}")
    if len(ids) < 2:
        raise LadderError(f"need at least 2 tokens to measure perplexity, got {len(ids)}")
    if window > model.config.max_seq_len:
        raise LadderError(f"--window {window} exceeds the model's max_seq_len {model.config.max_seq_len}")
    device = model.device
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    nll, count = 0.0, 0
    for begin, end, first in tqdm(windows(len(ids), window, stride), desc="eval", unit="window",
                                  disable=not progress, dynamic_ncols=True):
        logits = model(tokens[None, begin:end]).float()  # (1, T, V): causal forward, no cache
        targets = tokens[first:end]  # positions first..end-1, predicted from the position before each
        pred = logits[0, first - 1 - begin:end - 1 - begin]
        nll += F.cross_entropy(pred, targets, reduction="sum").item()
        count += targets.numel()
    method = (f"chunked windows of {window} tokens (consecutive windows share one token)" if stride == window - 1
              else f"sliding windows of {window} tokens, stride {stride}")
    return {"perplexity": math.exp(nll / count), "nll_per_token": nll / count, "n_scored": count,
            "n_tokens": len(ids), "window": window, "stride": stride,
            "method": f"token-level, {method}, every token after the first scored once"}


@torch.inference_mode()
def compare(model: Transformer, reference: Transformer, ids: list[int], window: int = 512,
            progress: bool = True) -> dict[str, Any]:
    """How far `model` is from `reference` on `ids`, over the windows `perplexity` scores: each model's
    perplexity, the share of positions where their greedy next tokens agree, and the mean KL(reference ||
    model) of their next-token distributions (nats)."""
    if len(ids) < 2:
        raise LadderError(f"need at least 2 tokens to compare models, got {len(ids)}")
    if model.config.vocab_size != reference.config.vocab_size:
        raise LadderError(f"the models have vocabularies of {model.config.vocab_size} and "
                          f"{reference.config.vocab_size} tokens: they cannot be compared token for token")
    tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    nll, ref_nll, agree, kl, count = 0.0, 0.0, 0, 0.0, 0
    for begin, end, first in tqdm(windows(len(ids), window, window - 1), desc="compare", unit="window",
                                  disable=not progress, dynamic_ncols=True):
        scored = slice(first - 1 - begin, end - 1 - begin)
        logp = F.log_softmax(model(tokens[None, begin:end]).float()[0, scored], dim=-1)  # (n, V)
        ref_logp = F.log_softmax(reference(tokens[None, begin:end].to(reference.device)).float()[0, scored].to(
            logp.device), dim=-1)
        targets = tokens[first:end]
        nll -= logp.gather(-1, targets[:, None]).sum().item()
        ref_nll -= ref_logp.gather(-1, targets[:, None]).sum().item()
        agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
        kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        count += targets.numel()
    return {"perplexity": math.exp(nll / count), "reference_perplexity": math.exp(ref_nll / count),
            "agreement": agree / count, "kl": kl / count, "n_scored": count, "window": window}
