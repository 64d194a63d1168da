"""Attention's parts: rotary embeddings, the cache mask, and the kernels: ATen's scaled dot-product attention,
and for a decode step (one query a row over the KV cache) two batched matrix products (an eager step in
half precision), products and sums that inductor compiles, or FlexAttention
(`ladder.options.DECODE_ATTENTION_KERNELS`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ladder.model.config import ModelConfig


def rope_inverse_frequencies(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim/2,), with Llama-3.1 scaling when the config has it."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cache_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """(B, 1, T, kv_len): the first kv_len cache positions a query at each of positions (B, T) sees, its own and
    those before it."""
    return (torch.arange(kv_len, device=positions.device) <= positions[..., None])[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the Hugging Face ("rotate half") layout. x: (B, H, T, hd), cos/sin: (B, 1, T, hd)."""
    return x * cos + rotate_half(x) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, decode_kernel: str = "sdpa",
           compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Scaled dot-product attention (causal without a mask). One query a row with a mask (a decode step)
    attends through `decode_kernel` (`ladder.options.DECODE_ATTENTION_KERNELS`; "products" up to
    DECODE_ATTENTION_MAX_POSITIONS cached positions, ATen's beyond, where the two cost the same, unless
    ATen's would upcast: see `products_attend`; "matmul" in the cache's dtype, so ATen's where
    `compute_dtype` upcasts); every other attention through ATen's
    `scaled_dot_product_attention`, in `compute_dtype` when one is given (an engine gives float32 for half
    precision on a CPU without bf16 arithmetic: AVX2 emulates bf16, and SmolLM2's decode attention ran 2.5x
    slower in it than upcast; the KV cache stays in the model's dtype)."""
    dtype = q.dtype
    if q.shape[2] == 1 and mask is not None:
        if decode_kernel == "products" and products_attend(k.shape[2], compute_dtype):
            return decode_attention(q, k, v, mask).to(dtype)
        if decode_kernel == "matmul" and compute_dtype is None:
            return matmul_decode_attention(q, k, v, mask)
        if decode_kernel == "flex":
            return flex_decode_attention(q, k, v, mask)
    if compute_dtype is not None:
        q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).to(dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).to(dtype)


# Up to this many cached positions, the "products" decode attention computes as products and sums: 30
# attentions of SmolLM2's shape in one compiled graph took 1.9 ms against ATen's flash kernel's 5.7 at 256
# positions, 15 against 25 at 2048, and as long at 4096 (experiments/investigations/decode_attention.py).
DECODE_ATTENTION_MAX_POSITIONS = 4096


def products_attend(positions: int, compute_dtype: torch.dtype | None) -> bool:
    """Whether the "products" decode attention takes `positions` cached positions. Past
    DECODE_ATTENTION_MAX_POSITIONS too when ATen's kernel would upcast the cache (`compute_dtype`): that
    copies every cached key and value to float32 first, and the products read them as they are. SmolLM2's
    shape, compiled, bf16 cache on a 2-core AVX2 CPU, ms an attention, products against upcast flash: batch 1,
    1.6 / 3.4 at 8192 positions, 4.6 / 8.2 at 16384; batch 8 at 8192, 17.7 / 81.4 (two 50 MB copies a
    layer, each mapped afresh by the allocator). One kernel for every length also makes one graph of a
    compiled layer's attention, not two (`--compile-layers`' warm-up)."""
    return compute_dtype is not None or positions <= DECODE_ATTENTION_MAX_POSITIONS


def flex_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query a row through FlexAttention (compiled only): on a GPU its decoding kernel, which
    splits the cache among thread blocks, with the mask (B, 1, 1, S) applied to the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    visible = mask[:, 0, 0]  # (B, S)

    def hide_the_invisible(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                           kv_idx: torch.Tensor) -> torch.Tensor:
        return torch.where(visible[b, kv_idx], score, -float("inf"))
    return flex_attention(q, k, v, score_mod=hide_the_invisible, enable_gqa=True)


def matmul_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query a row, q (B, H, 1, hd), over the cache k, v (B, n_kv, S, hd), as two batched
    matrix products in the cache's dtype (oneDNN's bf16 kernels on a CPU with bf16 arithmetic) and a float32
    softmax; the query heads of a KV head are the rows of one product (grouped-query attention). ATen's CPU
    flash kernel in bf16 is slow for one query: SmolLM2's eager bf16 step at batch 8 took 75 ms with it
    against 42 at 128 positions, 152 against 77 at 512, 367 against 97 at 2048 (upcast to float32: 53, 68,
    469); at batch 1, about the same up to 512 positions, 130 against 52 at 2048; 2-core AVX-512 BF16 EPYC,
    experiments/investigations/eager_decode_attention.py. With AMX tiles ATen's kernel is the faster: batch
    8, 44 ms against 48 at 128 positions, 50 against 56 at 512, 66 against 96 at 2048; batch 1, 35-42 against
    40-47 (2-core Xeon), so an engine attends through it there."""
    B, H, _, hd = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    # k times q's transpose, not q times k's: the cache's rows are a strided slice, which bmm copies when transposed
    scores = torch.matmul(k, q.view(B, n_kv, H // n_kv, hd).transpose(-1, -2)).transpose(-1, -2).float() * hd ** -0.5
    weights = scores.masked_fill(~mask.view(B, 1, 1, S), float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(weights, v).view(B, H, 1, hd)  # (B, n_kv, H / n_kv, hd) as heads


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query a row, q (B, H, 1, hd), over the cache k, v (B, n_kv, S, hd), in float32, as
    products and sums that inductor compiles into one loop nest: ATen's flash kernel costs more to enter
    (its blocks, an upcast copy of the whole cache) than a decode step's attention costs to compute. The
    query heads of a KV head broadcast against it (grouped-query attention)."""
    B, H, _, hd = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    grouped = q.float().view(B, n_kv, H // n_kv, 1, hd)
    scores = (grouped * k.float().unsqueeze(2)).sum(-1) * hd ** -0.5  # (B, n_kv, H / n_kv, S)
    scores = scores.masked_fill(~mask.view(B, 1, 1, S), float("-inf"))
    out = (scores.softmax(-1).unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2)  # (B, n_kv, H / n_kv, hd)
    return out.view(B, H, 1, hd)
