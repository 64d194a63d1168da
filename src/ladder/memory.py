"""How much memory one rank needs, estimated before anything is built: `ladder bench` refuses what
cannot fit before launching, and `ladder predict` marks the rows that could not run."""

from __future__ import annotations

import os

import torch

from ladder.config import ModelConfig, ShardShape

MEMORY_USABLE = 0.9  # of a device's memory; the rest is the allocator's, CUDA's and the graphs' own


def estimate_memory_bytes(config: ModelConfig, tp: int, batch: int, prompt_len: int, seq: int, dtype_bytes: int,
                          models: int = 1, weight_sets: int = 1) -> int:
    """One rank's weights (shared by the `models` models: one set, unless `weight_sets` says otherwise),
    the KV cache of each model, and the largest activation (one model runs at a time: the prefill's),
    in bytes, for rank 0 (which holds the most heads when they do not divide evenly). tests/test_bench.py
    holds it to the peaks measured on an H100."""
    shard = ShardShape.of(config, 0, tp)
    vocab_weights = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)  # whole on every rank
    weights = (config.n_params() - vocab_weights) / tp + vocab_weights
    kv_cache = 2 * config.n_layers * batch * shard.n_kv_heads * seq * config.head_dim
    # The prefill of one layer: its inputs, norms and outputs (dim wide), the MLP's gate, up and product
    # (ffn / tp wide), and the attention scores in case SDPA takes its math path; then the logits of the
    # last position only (in float32).
    tokens = batch * prompt_len
    activations = (tokens * (4 * config.dim + 3 * shard.ffn_hidden)
                   + batch * shard.n_heads * prompt_len * seq
                   + batch * config.vocab_size * 4 // dtype_bytes)
    return int((weight_sets * weights + models * kv_cache + activations) * dtype_bytes)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fits_in(need_bytes: int, device_bytes: int) -> bool:
    """Whether a rank needing `need_bytes` (`estimate_memory_bytes`) fits a device of `device_bytes`."""
    return need_bytes <= MEMORY_USABLE * device_bytes
