"""A Llama-family decoder with every residual layout, tensor-parallel by construction.

One implementation serves all layouts. Standard and parallel are local to a block; ladder crosses
block boundaries (a module reads the residual one module stale, and its all-reduce is waited on
only when a later module needs it), so the layout lives in `Transformer.forward`'s module loop.

Tensor parallelism (Megatron style): each rank holds `n_heads / tp` query heads with their key/value
heads (split, or replicated when tp exceeds the KV head count), and `ffn_hidden / tp` MLP columns.
The attention and MLP output projections are row-parallel, so each module returns a *partial* sum
that the communicator all-reduces. The model is TP-agnostic: it derives its local shapes from the
communicator it is built with and never mutates the config.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladder.comm.base import Communicator, Done, LocalCommunicator
from ladder.errors import LadderError
from ladder.model.attention import apply_rope, attend, cache_mask, rope_inverse_frequencies
from ladder.model.config import ModelConfig, ShardShape
from ladder.model.schedule import ladder_residual

HALF_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PartialStream:
    """The residual stream of a cache-free forward where it enters layer `layer`: `r` without the last
    module's output `pending` (how a ladder layer there reads it; a standard one adds `pending` first).
    Two models that share their first layers compute it once (`Transformer.stream_before`), and each goes
    on from it (`forward(resume_from=...)`): distillation's teacher and its partly converted student."""

    layer: int
    r: torch.Tensor  # (B, T, dim)
    pending: torch.Tensor  # (B, T, dim), already all-reduced


@dataclass(frozen=True)
class RowGroup:
    """KV-cache rows `rows` in a mixed forward (`Transformer.forward_mixed`): their B x T tokens are tokens
    begin..end - 1 of its flat batch, at cache positions (B, T), with their RoPE and mask."""

    rows: slice
    begin: int
    positions: torch.Tensor  # (B, T)
    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor  # (B, 1, T, S)

    @property
    def end(self) -> int:
        return self.begin + self.positions.numel()


Rows = slice | tuple[RowGroup, ...] | None  # the cache rows a forward's batch holds (None: the first B)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the gain, as Hugging Face's LlamaRMSNorm does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class KVCache(nn.Module):
    """A static key/value cache, allocated once for the longest sequence it will hold."""

    def __init__(self, batch: int, n_kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: slice | None = None,
               kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hd) at each row's positions `input_pos` (B, T) into cache rows `rows`
        (default: the first B); return those rows' first `kv_len` keys and values (default: all)."""
        rows = rows if rows is not None else slice(0, k.shape[0])
        row_index = torch.arange(rows.start, rows.stop, device=k.device)[:, None]  # (B, 1)
        self.k[row_index, :, input_pos] = k.transpose(1, 2)  # indexed (B, T, n_kv, hd)
        self.v[row_index, :, input_pos] = v.transpose(1, 2)
        return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy a sequence's first `length` positions to another row (continuous batching keeps the
        running requests in the first rows)."""
        self.k[target, :, :length] = self.k[source, :, :length]
        self.v[target, :, :length] = self.v[source, :, :length]


class Attention(nn.Module):
    """This rank's attention heads. Returns a partial output: the sum over ranks is the true output."""

    def __init__(self, config: ModelConfig, shard: ShardShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shard.n_heads, shard.n_kv_heads, config.head_dim
        # Fused QKV: [q heads | k heads | v heads] of this rank only (split by heads before sharding).
        self.wqkv = nn.Linear(config.dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)  # row-parallel
        self.kv_cache: KVCache | None = None
        # How it attends: set by an engine on its own view of the model (`Transformer.view`)
        self.decode_kernel = "sdpa"
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor | None,
                mask: torch.Tensor | None, rows: Rows = None) -> torch.Tensor:
        qkv = self.wqkv(x)
        if isinstance(rows, tuple):  # a mixed forward: every token projected at once, each group attends on its own
            y = torch.cat([self._attend(qkv[:, g.begin:g.end].view(*g.positions.shape, -1), *g.rope, g.positions,
                                        g.mask, g.rows).view(1, g.end - g.begin, -1) for g in rows], dim=1)
        else:
            y = self._attend(qkv, cos, sin, input_pos, mask, rows)
        return self.wo(y)  # (B, T, dim), partial

    def _attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor | None,
                mask: torch.Tensor | None, rows: slice | None) -> torch.Tensor:
        B, T, _ = qkv.shape
        hd = self.head_dim
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1)
        q = q.view(B, T, self.n_heads, hd).transpose(1, 2)  # (B, n_heads, T, hd)
        k = k.view(B, T, self.n_kv_heads, hd).transpose(1, 2)  # (B, n_kv, T, hd)
        v = v.view(B, T, self.n_kv_heads, hd).transpose(1, 2)  # (B, n_kv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None and input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v, rows, mask.shape[-1])  # (B, n_kv, S, hd)
        else:
            mask = None  # no cache: the prompt attends to itself, causally
        y = attend(q, k, v, mask, self.decode_kernel, self.compute_dtype)
        return y.transpose(1, 2).reshape(B, T, self.n_heads * hd)  # (B, T, n_heads * hd)


class FeedForward(nn.Module):
    """This rank's SwiGLU columns. Returns a partial output."""

    def __init__(self, config: ModelConfig, shard: ShardShape) -> None:
        super().__init__()
        self.hidden = shard.ffn_hidden
        self.w13 = nn.Linear(config.dim, 2 * self.hidden, bias=False)  # fused [gate | up], column-parallel
        self.w2 = nn.Linear(self.hidden, config.dim, bias=False)  # down, row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)  # (B, T, hidden) each
        return self.w2(F.silu(gate) * up)  # (B, T, dim), partial


class Block(nn.Module):
    """One layer's two modules. Which output a module adds to the stream, and the all-reduces, belong to
    `Transformer.forward`."""

    STEPS = ("attention_step", "mlp_step", "parallel_step")  # what `ladder.runtime.compile.compile_layers` compiles
    MASKED = ("attention_step", "parallel_step")  # their sixth argument (the layer first) is the mask

    def __init__(self, config: ModelConfig, shard: ShardShape) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, shard)
        # The parallel layout has one shared norm per layer; every other layout has two.
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps) if config.layout != "parallel" else None
        self.feed_forward = FeedForward(config, shard)

    def attention_branch(self, r: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                         input_pos: torch.Tensor | None, mask: torch.Tensor | None,
                         rows: Rows = None) -> torch.Tensor:
        return self.attention(self.attention_norm(r), *rope, input_pos, mask, rows)

    def mlp_branch(self, r: torch.Tensor) -> torch.Tensor:
        assert self.ffn_norm is not None
        return self.feed_forward(self.ffn_norm(r))

    def parallel_branch(self, r: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                        input_pos: torch.Tensor | None, mask: torch.Tensor | None,
                        rows: Rows = None) -> torch.Tensor:
        u = self.attention_norm(r)
        return self.attention(u, *rope, input_pos, mask, rows) + self.feed_forward(u)

    # A step is a branch with the residual add before it: r + arrived (the module output that the layout
    # adds to the stream here, or zeros), and the branch's output of that sum. Compiled as one graph
    # (`ladder.runtime.compile.compile_layers`), the add fuses into the norm's kernel instead of running as a kernel
    # of its own between two compiled graphs: 2 of a decode step's ~13 small kernels a layer on a GPU.

    def attention_step(self, r: torch.Tensor, arrived: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       input_pos: torch.Tensor | None, mask: torch.Tensor | None,
                       rows: Rows = None) -> tuple[torch.Tensor, torch.Tensor]:
        r = r + arrived
        return r, self.attention_branch(r, rope, input_pos, mask, rows)

    def mlp_step(self, r: torch.Tensor, arrived: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = r + arrived
        return r, self.mlp_branch(r)

    def parallel_step(self, r: torch.Tensor, arrived: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      input_pos: torch.Tensor | None, mask: torch.Tensor | None,
                      rows: Rows = None) -> tuple[torch.Tensor, torch.Tensor]:
        r = r + arrived
        return r, self.parallel_branch(r, rope, input_pos, mask, rows)


# Compiled, a layer's module runs as a nested compile region: dynamo traces the first layer's and stamps its
# graph out for every later layer whose inputs and guards match, instead of tracing each layer's Python again
# (SmolLM2's decode step traced in 3.1 s, not 9.1, on a 2-core AVX2 CPU). `ladder.runtime.compile` flattens
# the copies back into one graph: inductor compiles what it compiled before. Eager, a region is a call.
# Flat arguments (the layer, tensors, None) are matched at once; a slice of rows is not, so such a call
# traces its own, and a layer that matches no entry adds one (a limit of entries would fail the compile).
compile_region = torch.compiler.nested_compile_region(max_reuse_entries=1 << 20)
MASK_CACHE_DIM = 3  # a decode mask's (B, 1, T, cache positions): dynamic in compiled layers' attention


@compile_region
def attention_region(layer: Block, r: torch.Tensor, arrived: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     input_pos: torch.Tensor | None, mask: torch.Tensor | None,
                     rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.attention_step(r, arrived, (cos, sin), input_pos, mask, rows)


@compile_region
def mlp_region(layer: Block, r: torch.Tensor, arrived: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.mlp_step(r, arrived)


@compile_region
def parallel_region(layer: Block, r: torch.Tensor, arrived: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    input_pos: torch.Tensor | None, mask: torch.Tensor | None,
                    rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.parallel_step(r, arrived, (cos, sin), input_pos, mask, rows)


class Transformer(nn.Module):
    """The whole decoder on one tensor-parallel rank.

    Build it on the meta device and materialise only this rank's shard (see `ladder.model.weights`).
    `forward(tokens, input_pos)` returns full-vocabulary logits (B, T, vocab) on every rank.
    """

    def __init__(self, config: ModelConfig, comm: Communicator | None = None,
                 shard_vocab: bool = False) -> None:
        super().__init__()
        self.config = config
        self.comm: Communicator = comm or LocalCommunicator()
        tp, rank = self.comm.world_size, self.comm.rank
        self.shard_vocab = shard_vocab and tp > 1
        if self.shard_vocab and config.vocab_size % tp:
            raise LadderError(f"vocab_size {config.vocab_size} is not divisible by tensor-parallel degree {tp}")
        self.shard = ShardShape.of(config, rank, tp, self.shard_vocab)
        # Built on meta, filled later (ladder.model.weights). Given its storage, nn.Embedding skips its normal_
        # initialiser: on meta, torch runs it through a Python reference whose first use imports
        # torch._dynamo, seconds of every command's start-up.
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim,
                                           _weight=torch.empty(config.vocab_size, config.dim))
        self.layers = nn.ModuleList(Block(config, self.shard) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, self.shard.vocab_size, bias=False)
        self.tie_weights()
        # computed once materialised (`reset_buffers`): arange on meta would import torch._dynamo too
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        self.max_batch = self.max_seq = 0
        self.layers_compiled = self.layers_saved = False  # `compile_layers`

    def tie_weights(self) -> None:
        """Share the embedding with the output head (tied models, unsharded vocabulary).
        `to_empty()` unties parameters, so materialisation calls this again."""
        if self.config.tie_embeddings and not self.shard_vocab:
            self.output.weight = self.tok_embeddings.weight

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    # ---- buffers that do not come from a checkpoint ---------------------------------------------

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (needed after `to_empty()` from the meta device)."""
        self.inv_freq = rope_inverse_frequencies(self.config, self.inv_freq.device)

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """Allocate static KV caches for up to `max_batch` sequences of `max_seq` tokens."""
        if max_seq > self.config.max_seq_len:
            raise LadderError(f"a cache of {max_seq} tokens exceeds max_seq_len {self.config.max_seq_len}")
        if max_batch <= self.max_batch and max_seq == self.max_seq:
            return
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch, self.shard.n_kv_heads, max_seq,
                                               self.config.head_dim, weight.dtype, weight.device)
        cos, sin = self.rope(torch.arange(max_seq, device=weight.device)[None], torch.float32)
        self.register_buffer("rope_cos", cos[0, 0], persistent=False)  # (max_seq, hd): `cached_rope`
        self.register_buffer("rope_sin", sin[0, 0], persistent=False)
        self.max_batch, self.max_seq = max_batch, max_seq

    def view(self) -> Transformer:
        """A copy of this model's modules that shares its tensors (weights, buffers) and communicator: an
        engine changes how its own view computes (its linear layers' form, its attention, compiled steps)
        and leaves the model that its caller holds as it was."""
        shared = {id(t): t for t in itertools.chain(self.parameters(), self.buffers())}
        shared[id(self.comm)] = self.comm
        view = copy.deepcopy(self, shared)
        for layer in view.layers:  # caches of its own (`setup_caches`), not the model's
            layer.attention.kv_cache = None
        view.max_batch = view.max_seq = 0
        return view

    def attend_with(self, decode_kernel: str, compute_dtype: torch.dtype | None) -> None:
        """How every layer attends (`attend`): set on a view (`view`), before its steps compile."""
        for layer in self.layers:
            layer.attention.decode_kernel, layer.attention.compute_dtype = decode_kernel, compute_dtype

    def use_caches_of(self, other: Transformer) -> None:
        """Read and write `other`'s KV caches and RoPE tables (another view of one model: `view`)."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.attention.kv_cache = theirs.attention.kv_cache
        self.register_buffer("rope_cos", other.rope_cos, persistent=False)
        self.register_buffer("rope_sin", other.rope_sin, persistent=False)
        self.max_batch, self.max_seq = other.max_batch, other.max_seq

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, T, hd) of each row's positions (B, T), to broadcast over heads."""
        freqs = positions.float()[..., None] * self.inv_freq  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cached_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` of cache positions (B, T), gathered from the tables `setup_caches` built. Compiled, a
        decode step then reads cos and sin where inductor inlined their computation into every loop that
        uses them: each attention's loop over the cache computed them once per cached key."""
        return self.rope_cos[positions][:, None].to(dtype), self.rope_sin[positions][:, None].to(dtype)

    # ---- forward ---------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None,
                last_only: bool = False, rows: slice | None = None, kv_len: int | None = None,
                resume_from: PartialStream | None = None) -> torch.Tensor:
        """tokens (B, T); input_pos: each row's cache positions (B, T) (a (T,) vector stands for every
        row's), or None for a cache-free causal forward. The rows are KV-cache rows `rows` (default: the
        first B), and attend to the first `kv_len` cache positions only (continuous batching, `ladder.serve`).
        `last_only`: logits of the last position only, (B, 1, vocab), all that sampling needs after a
        prefill (every position's: 17 GB for Llama-3 at batch 64, prompt 1024, bf16).
        `resume_from`: a cache-free forward of these tokens from the stream where it enters a later layer
        (`stream_before`), instead of from the embedding."""
        if resume_from is not None:
            if input_pos is not None or self.config.layout not in ("standard", "ladder"):
                raise LadderError("resume_from is a cache-free forward of the standard, ladder or hybrid layout")
            rope = self._cache_free_rope(tokens, resume_from.r.dtype)
            r = self._ladder_layers(resume_from.r, rope, None, None, None, first=resume_from.layer,
                                    pending=[Done(resume_from.pending)])
        else:
            r = self._layers(tokens, input_pos, rows, kv_len)
        if last_only:
            r = r[:, -1:]
        logits = self.head(r)  # (B, T, vocab or vocab / tp)
        if self.shard_vocab:
            logits = self.comm.all_gather_last_dim(logits)  # (B, T, vocab)
        return logits

    def _layers(self, tokens: torch.Tensor, input_pos: torch.Tensor | None, rows: slice | None,
                kv_len: int | None) -> torch.Tensor:
        """The residual stream after the last layer, from the embedding of tokens (B, T)."""
        B, T = tokens.shape
        r = self.tok_embeddings(tokens)  # (B, T, dim)
        positions = (input_pos if input_pos is not None else torch.arange(T, device=tokens.device)).expand(B, T)
        if input_pos is None:
            rope, mask = self.rope(positions, r.dtype), None
        else:
            if self.max_seq == 0:
                raise RuntimeError("call setup_caches() before a forward with input_pos")
            input_pos = positions
            rope, mask = self.cached_rope(positions, r.dtype), cache_mask(positions, kv_len or self.max_seq)
            if self.layers_compiled and not self.layers_saved:  # one graph for every cache length (`compile_layers`)
                torch._dynamo.maybe_mark_dynamic(mask, MASK_CACHE_DIM)
        return self._layout_layers(r, rope, input_pos, mask, rows)

    def forward_mixed(self, groups: Sequence[tuple[slice, torch.Tensor, torch.Tensor, int]]) -> torch.Tensor:
        """One forward of groups of KV-cache rows, each (rows, tokens (B, T), positions (B, T), cache positions
        read): a server step's running rows (T = 1) and prompt chunks together. Every linear layer reads its
        weights once for all the tokens; each group attends over its own rows. Logits (sum of B, vocab) of
        each row's last token, in order."""
        tokens = torch.cat([t.reshape(-1) for _, t, _, _ in groups])[None]  # (1, N)
        r = self.tok_embeddings(tokens)  # (1, N, dim)
        parts, lasts, begin = [], [], 0
        for rows, group_tokens, positions, kv_len in groups:
            parts.append(RowGroup(rows, begin, positions, self.cached_rope(positions, r.dtype),
                                  cache_mask(positions, kv_len)))
            B, T = group_tokens.shape
            lasts += range(begin + T - 1, begin + B * T, T)
            begin += B * T
        r = self._layout_layers(r, (None, None), None, None, tuple(parts))
        logits = self.head(r[:, torch.tensor(lasts, device=r.device)])  # (1, rows, vocab or vocab / tp)
        return (self.comm.all_gather_last_dim(logits) if self.shard_vocab else logits)[0]

    def _layout_layers(self, r: torch.Tensor, rope, input_pos, mask, rows: Rows) -> torch.Tensor:
        layout = self.config.layout
        if layout == "parallel":
            return self._parallel_layers(r, rope, input_pos, mask, rows)
        if layout in ("desync", "upper-bound"):
            return self._unsynchronised_layers(r, rope, input_pos, mask, rows)
        return self._ladder_layers(r, rope, input_pos, mask, rows)

    def stream_before(self, tokens: torch.Tensor, layer: int) -> PartialStream:
        """The residual stream of a cache-free forward of tokens (B, T) where it enters `layer` (0 < layer
        <= n_layers), from this model's layers before it. Standard, ladder and hybrid layouts, TP 1."""
        if self.config.layout not in ("standard", "ladder") or self.comm.world_size != 1:
            raise LadderError("stream_before is a TP-1 forward of the standard, ladder or hybrid layout")
        if not 0 < layer <= self.config.n_layers:
            raise LadderError(f"stream_before: layer {layer} is not in 1..{self.config.n_layers}")
        r = self.tok_embeddings(tokens)
        modules = self._residual_modules(self._cache_free_rope(tokens, r.dtype), None, None, None, end=layer)
        r, (last,) = ladder_residual(r, modules, self.comm, 2 * self.config.first_ladder_layer,
                                     2 * self.config.n_layers, nothing=torch.zeros_like(r), hand_on=1)
        return PartialStream(layer, r, last.wait())

    def _cache_free_rope(self, tokens: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0..T-1 for every row of tokens (B, T)."""
        return self.rope(torch.arange(tokens.shape[1], device=tokens.device).expand(*tokens.shape), dtype)

    def head(self, r: torch.Tensor) -> torch.Tensor:
        """The final norm and the output head: logits (B, T, vocab on this rank) of the stream r (B, T, dim)."""
        return self.output(self.norm(r))

    def _residual_modules(self, rope, input_pos, mask, rows, first: int = 0, end: int | None = None):
        """The modules of layers first..end-1 (default: all 2L) in execution order, as (index, step) pairs:
        step(r, arrived) adds `arrived` to the stream r and returns the sum and the module's output of it
        (`Block.attention_step`), each a compile region (`attention_region`)."""
        for i in range(first, self.config.n_layers if end is None else end):
            layer = self.layers[i]
            yield 2 * i, lambda r, arrived, layer=layer: attention_region(layer, r, arrived, *rope, input_pos, mask,
                                                                          rows)
            yield 2 * i + 1, functools.partial(mlp_region, layer)

    def _ladder_layers(self, r, rope, input_pos, mask, rows, first: int = 0, pending=None) -> torch.Tensor:
        """Standard, ladder and hybrid: the ladder recurrence (`ladder.model.schedule.ladder_residual`), from
        layer `first` with the outputs `pending` not yet added."""
        n_modules = 2 * self.config.n_layers
        r, _ = ladder_residual(r, self._residual_modules(rope, input_pos, mask, rows, first), self.comm,
                               2 * self.config.first_ladder_layer, n_modules, nothing=torch.zeros_like(r),
                               pending=pending)
        return r

    def _parallel_layers(self, r, rope, input_pos, mask, rows) -> torch.Tensor:
        """GPT-J / PaLM: r = r + AR(A(u) + M(u)), u = norm(r). One blocking all-reduce per layer."""
        arrived = torch.zeros_like(r)
        for layer in self.layers:
            r, y = parallel_region(layer, r, arrived, *rope, input_pos, mask, rows)
            arrived = self.comm.all_reduce(y)
        return r + arrived

    def _unsynchronised_layers(self, r, rope, input_pos, mask, rows) -> torch.Tensor:
        """Desync and upper bound: each rank keeps its own residual stream.

        reduced module:      r = AR(h(r) + r / T)   (re-synchronises the streams)
        not reduced module:  r = r + h(r)           (rank-local; streams diverge)
        Upper bound reduces nothing: it is not a valid model, only a speed ceiling.
        """
        tp = self.comm.world_size
        upper_bound = self.config.layout == "upper-bound"
        nothing = arrived = torch.zeros_like(r)
        for j, module in self._residual_modules(rope, input_pos, mask, rows):
            r, y = module(r, arrived)
            if not upper_bound and self.config.desync_reduces(j):
                r, arrived = self.comm.all_reduce(y + r / tp), nothing
            else:
                arrived = y
        return r + arrived
