"""Weights: Hugging Face tensor names, per-rank slicing, materialisation and initialisation.

Checkpoints on disk keep the unfused Hugging Face Llama names (`model.layers.3.self_attn.q_proj.weight`).
Each rank asks a `TensorSource` only for the rows or columns it owns, so a safetensors file is read
slice by slice and a 70B checkpoint never sits whole in one rank's memory. The fused QKV and
gate/up matrices are assembled per rank after slicing by heads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

from ladder.comm.base import Communicator
from ladder.errors import LadderError
from ladder.model.config import ModelConfig, ShardShape
from ladder.model.transformer import Block, RMSNorm, Transformer

Slice = tuple[slice, slice]  # (rows, columns)
ALL: Slice = (slice(None), slice(None))


class TensorSource(Protocol):
    """Where weights come from: an in-memory dict, safetensors files, a GGUF file."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, index: Slice = ALL) -> torch.Tensor: ...


class DictSource:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str, index: Slice = ALL) -> torch.Tensor:
        t = self.tensors[name]
        return t[index] if t.dim() == 2 else t[index[0]]


def hf_names(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every Hugging Face tensor name of the unsharded model with its shape."""
    d, hd, f = config.dim, config.head_dim, config.ffn_hidden
    yield "model.embed_tokens.weight", (config.vocab_size, d)
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (d,)
        yield p + "self_attn.q_proj.weight", (config.n_heads * hd, d)
        yield p + "self_attn.k_proj.weight", (config.n_kv_heads * hd, d)
        yield p + "self_attn.v_proj.weight", (config.n_kv_heads * hd, d)
        yield p + "self_attn.o_proj.weight", (d, config.n_heads * hd)
        if config.layout != "parallel":
            yield p + "post_attention_layernorm.weight", (d,)
        yield p + "mlp.gate_proj.weight", (f, d)
        yield p + "mlp.up_proj.weight", (f, d)
        yield p + "mlp.down_proj.weight", (d, f)
    yield "model.norm.weight", (d,)
    if not config.tie_embeddings:
        yield "lm_head.weight", (config.vocab_size, d)


def _rows(start: int, count: int) -> Slice:
    return slice(start, start + count), slice(None)


def _cols(start: int, count: int) -> Slice:
    return slice(None), slice(start, start + count)


def shard_plan(config: ModelConfig, shard: ShardShape, rank: int
               ) -> Iterator[tuple[str, list[tuple[str, Slice]]]]:
    """For each parameter of our model: the Hugging Face tensors (and slices) it concatenates."""
    hd = config.head_dim
    q_rows = _rows(shard.first_head * hd, shard.n_heads * hd)
    kv_rows = _rows(shard.first_kv_head * hd, shard.n_kv_heads * hd)
    ffn_rows = _rows(rank * shard.ffn_hidden, shard.ffn_hidden)
    yield "tok_embeddings.weight", [("model.embed_tokens.weight", ALL)]
    for i in range(config.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        yield p + "attention_norm.weight", [(q + "input_layernorm.weight", ALL)]
        yield p + "attention.wqkv.weight", [(q + "self_attn.q_proj.weight", q_rows),
                                            (q + "self_attn.k_proj.weight", kv_rows),
                                            (q + "self_attn.v_proj.weight", kv_rows)]
        yield p + "attention.wo.weight", [(q + "self_attn.o_proj.weight",
                                           _cols(shard.first_head * hd, shard.n_heads * hd))]
        if config.layout != "parallel":
            yield p + "ffn_norm.weight", [(q + "post_attention_layernorm.weight", ALL)]
        yield p + "feed_forward.w13.weight", [(q + "mlp.gate_proj.weight", ffn_rows),
                                              (q + "mlp.up_proj.weight", ffn_rows)]
        yield p + "feed_forward.w2.weight", [(q + "mlp.down_proj.weight", _cols(rank * shard.ffn_hidden,
                                                                                 shard.ffn_hidden))]
    yield "norm.weight", [("model.norm.weight", ALL)]
    head = "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
    yield "output.weight", [(head, _rows(shard.first_vocab_row, shard.vocab_size))]


def build_model(config: ModelConfig, comm: Communicator, device: torch.device,
                dtype: torch.dtype = torch.float32, shard_vocab: bool = False,
                blocks_later: bool = False) -> Transformer:
    """Build on the meta device, then allocate (uninitialised) only this rank's shard on `device`, in
    `dtype` directly. `blocks_later`: leave the blocks on the meta device for `load_weights` or
    `init_local_shard` to allocate one at a time, so that a quantized shard is never held whole
    unquantized (each block is quantized as soon as it is filled: `after_block`)."""
    with torch.device("meta"):
        model = Transformer(config, comm, shard_vocab=shard_vocab).to(dtype)
    _allocate(model, device, recurse=False)
    for name, part in model.named_children():
        if not (blocks_later and name == "layers"):
            _allocate(part, device)
    model.tie_weights()
    model.reset_buffers()
    return model


def _allocate(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """`module.to_empty(device=device)`: uninitialised tensors of its parameters' and buffers' shapes. Not
    through `to_empty`, whose `empty_like` of a meta tensor runs torch's Python reference, which imports
    sympy: part of every start that nothing else in an eager run needs (docs/configuration.md)."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), recurse=recurse)


def _allocated(block: nn.Module, device: torch.device) -> nn.Module:
    """A block left on the meta device by `build_model(blocks_later=True)`, allocated now."""
    if any(p.is_meta for p in block.parameters()):
        _allocate(block, device)
    return block


def _block_index(entry: tuple[str, object]) -> int | None:
    """The layer a shard plan's parameter belongs to (None: the embedding, final norm and head)."""
    name = entry[0]
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def share_weights(config: ModelConfig, comm: Communicator, like: Transformer) -> Transformer | None:
    """A model of `config`'s layout computing with `like`'s weights (no copy), or None when `like` lacks
    some of its parameters. Standard, ladder, hybrid, desync and upper-bound differ only in how
    `forward` wires the same modules; parallel has one norm per layer where they have two, so it can
    share theirs (using the attention norm for both modules) but they cannot share parallel's."""
    with torch.device("meta"):
        model = Transformer(config, comm, shard_vocab=like.shard_vocab)
    state = like.state_dict()
    needed = model.state_dict().keys()
    if not needed <= state.keys():
        return None
    model.load_state_dict({name: state[name] for name in needed}, assign=True)
    model.tie_weights()
    model.inv_freq = like.inv_freq
    return model


def load_weights(model: Transformer, source: TensorSource,
                 after_block: Callable[[nn.Module], None] | None = None) -> None:
    """Copy this rank's slices of every Hugging Face tensor in `source` into `model`, block by block
    (allocating blocks that `build_model` left for later), calling `after_block` on each block filled."""
    config, rank = model.config, model.comm.rank
    available = source.names()
    tied = config.tie_embeddings and not model.shard_vocab  # the head shares the embedding's storage
    plan = [(name, parts) for name, parts in shard_plan(config, model.shard, rank) if not (tied and name == "output.weight")]
    for index, entries in itertools.groupby(plan, key=_block_index):
        if index is not None:
            _allocated(model.layers[index], model.device)
        for name, parts in entries:
            missing = [hf for hf, _ in parts if hf not in available]
            if missing:
                raise LadderError(f"checkpoint has no tensor {missing[0]!r}")
            _copy_pieces(source, parts, model.get_parameter(name), name)
        if index is not None and after_block is not None:
            after_block(model.layers[index])


def init_hf_state_dict(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32
                       ) -> dict[str, torch.Tensor]:
    """The documented initialisation for training from scratch, in Hugging Face names.

    Linear and embedding weights ~ N(0, 0.02); the projections that write into the residual stream
    (o_proj, down_proj) are scaled by 1/sqrt(2 * n_layers) (GPT-2), norms start at 1. Every tensor is
    drawn from its own generator seeded by (seed, name), so the full model is identical on every
    rank and each rank can take its slices of the same weights.
    """
    std = 0.02
    out: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(hf_names(config)):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        scale = std / math.sqrt(2 * config.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        out[name] = (torch.randn(shape, generator=gen) * scale).to(dtype)
    return out


def init_local_shard(model: Transformer, seed: int = 0,
                     after_block: Callable[[nn.Module], None] | None = None) -> None:
    """Random weights drawn directly in this rank's shard: for speed benchmarks of models too large to
    build whole (the values differ from any single-process model; only their shapes are meaningful).
    Blocks as in `load_weights`: allocated if left for later, `after_block` called on each."""
    gen = torch.Generator(device=model.device).manual_seed(seed + 7919 * model.comm.rank)
    parts = [block for name, module in model.named_children() for block in (module if name == "layers" else [module])]
    seen: set[int] = set()  # a tied head's weight is the embedding's, drawn once
    with torch.no_grad():
        for part in parts:
            for name, p in _allocated(part, model.device).named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if name.endswith("norm.weight") or isinstance(part, RMSNorm):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
            if isinstance(part, Block) and after_block is not None:
                after_block(part)


def random_model(config: ModelConfig, comm: Communicator, device: torch.device,
                 dtype: torch.dtype = torch.float32, seed: int = 0, shard_vocab: bool = False,
                 exact: bool = True) -> Transformer:
    """A model with seeded random weights. `exact`: every rank holds slices of the same full model
    (so any TP degree computes the same function); otherwise each rank draws its shard directly."""
    model = build_model(config, comm, device, dtype, shard_vocab)
    fill_random(model, seed, exact)
    return model


def fill_random(model: Transformer, seed: int = 0, exact: bool = True,
                after_block: Callable[[nn.Module], None] | None = None) -> None:
    """`random_model`'s weights, into a model that `build_model` made."""
    if exact:
        load_weights(model, DictSource(init_hf_state_dict(model.config, seed)), after_block)
    else:
        init_local_shard(model, seed, after_block)


def hf_views(model: Transformer, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The unsharded model's parameters under Hugging Face names, as views that keep their autograd
    history (fused QKV and gate/up are split back). TP=1 only. `params`: the model's parameters as
    whole tensors, when they are not plain (e.g. gathered from FSDP shards)."""
    if model.comm.world_size != 1:
        raise LadderError("exporting weights needs the unsharded model (tp=1)")
    params = params or dict(model.named_parameters(remove_duplicate=False))
    shapes = dict(hf_names(model.config))
    out: dict[str, torch.Tensor] = {}
    for name, parts in shard_plan(model.config, model.shard, 0):
        if name == "output.weight" and model.config.tie_embeddings:
            continue
        sizes = [_length(index[0], shapes[hf][0]) for hf, index in parts]
        for (hf, _), piece in zip(parts, params[name].split(sizes, dim=0)):
            out[hf] = piece
    return out


def export_hf_state_dict(model: Transformer, params: dict[str, torch.Tensor] | None = None
                         ) -> dict[str, torch.Tensor]:
    """The unsharded model's weights under Hugging Face names, detached copies (TP=1 only)."""
    return {name: t.detach().contiguous() for name, t in hf_views(model, params).items()}


def rank_parameters(config: ModelConfig, hf: dict[str, torch.Tensor], rank: int, tp: int,
                    prefix: str = "") -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters (our names starting with `prefix`) cut from whole Hugging Face tensors:
    the same slices `load_weights` copies on a real rank, but differentiable (see `ladder.train.simulate`)."""
    source = DictSource(hf)
    return {name: _assemble(source, parts) for name, parts in shard_plan(config, ShardShape.of(config, rank, tp), rank)
            if name.startswith(prefix) and parts[0][0] in hf}


@torch.no_grad()
def _copy_pieces(source: TensorSource, parts: list[tuple[str, Slice]], param: torch.Tensor, name: str) -> None:
    """Copy a parameter's Hugging Face pieces (fused QKV and gate/up have several) into its rows one at a
    time: concatenated first, in float32, they were the largest tensor of a quantized load."""
    start = 0
    for hf, index in parts:
        piece = source.get(hf, index)
        if piece.shape[1:] != param.shape[1:] or start + piece.shape[0] > param.shape[0]:
            raise LadderError(f"tensor {hf} for {name} has shape {tuple(piece.shape)}, which does not fit "
                              f"{tuple(param.shape)} from row {start} (config and checkpoint disagree)")
        param[start:start + piece.shape[0]].copy_(piece)
        start += piece.shape[0]
    if start != param.shape[0]:
        raise LadderError(f"the tensors for {name} have {start} rows, the config implies {param.shape[0]} "
                          "(config and checkpoint disagree)")


def _assemble(source: TensorSource, parts: list[tuple[str, Slice]]) -> torch.Tensor:
    """One of our parameters from its Hugging Face pieces (fused QKV and gate/up are concatenated)."""
    pieces = [source.get(hf, index) for hf, index in parts]
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]


def _length(s: slice, n: int) -> int:
    return len(range(*s.indices(n)))
