"""Tensor-parallel ranks simulated in one process, so that desync models can be trained.

A desync model is a different function for every TP degree T: between all-reduces each rank's residual
stream is updated by that rank's heads and MLP columns only (docs/layouts.md). Training one for T ranks
therefore needs the T streams, not the TP=1 model. `SimulatedRanks` computes them in one process from
the whole (TP=1) weights: rank k's shard of each module is cut from the whole matrices with exactly the
slices `ladder.model.weights.load_weights` copies on a real rank k, but as differentiable views, so gradients
reach the whole weights. A model trained here, saved whole with `desync_tp = T`, runs unchanged on T
real ranks (`ladder eval --tp T`); tests/test_tp.py checks the two agree.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from ladder.errors import LadderError
from ladder.model.config import ShardShape
from ladder.model.transformer import Block, Transformer
from ladder.model.weights import hf_views, rank_parameters


class _RankBranch(nn.Module):
    """One rank's shard of one layer, built on the meta device: it only lends its code to
    `functional_call`, which runs it with that rank's slices of the whole weights."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, r: torch.Tensor, is_mlp: bool, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.block.mlp_branch(r) if is_mlp else self.block.attention_branch(r, rope, None, None)


class SimulatedRanks(nn.Module):
    """A TP=1 desync `Transformer` run as `tp` ranks: `forward(tokens)` returns the logits that `tp`
    real ranks would compute (cache-free, for training and evaluation)."""

    def __init__(self, model: Transformer, tp: int) -> None:
        super().__init__()
        config = model.config
        if config.layout != "desync":
            raise LadderError(f"simulated ranks are for the desync layout (other layouts compute the same "
                              f"function at every TP degree), got {config.layout!r}")
        if model.comm.world_size != 1:
            raise LadderError("simulated ranks need the whole model (built with tp=1)")
        config.check_tp(tp)
        self.model, self.tp = model, tp
        self.config = config
        with torch.device("meta"):
            # A plain list: these shells hold no weights of their own and must not appear as parameters.
            self._branches = [_RankBranch(Block(config, ShardShape.of(config, k, tp))) for k in range(tp)]

    @property
    def output(self) -> nn.Linear:
        """The output head (shared with the whole model): where `ladder.evaluate` finds the device."""
        return self.model.output

    def _rank_layer_weights(self) -> list[list[dict[str, torch.Tensor]]]:
        """[rank][layer] -> that rank's weights of that layer, named as in `Block`."""
        hf = hf_views(self.model)
        out = []
        for k in range(self.tp):
            params = rank_parameters(self.model.config, hf, k, self.tp, prefix="layers.")
            per_layer: list[dict[str, torch.Tensor]] = [{} for _ in self.model.layers]
            for name, tensor in params.items():
                _, layer, local = name.split(".", 2)
                per_layer[int(layer)]["block." + local] = tensor
            out.append(per_layer)
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab). The loop of `Transformer._unsynchronised_layers`, with the
        all-reduce written out: reduced module r = sum_k (h_k(r_k) + r_k / tp), else r_k = r_k + h_k(r_k)."""
        model, config = self.model, self.model.config
        r = model.tok_embeddings(tokens)  # (B, T, dim)
        rope = model.rope(torch.arange(tokens.shape[1], device=tokens.device)[None], r.dtype)  # every row alike
        weights = self._rank_layer_weights()
        streams = [r] * self.tp  # rank k's residual stream
        for j in range(2 * config.n_layers):
            layer, is_mlp = j // 2, j % 2 == 1
            outputs = [functional_call(self._branches[k], weights[k][layer], (streams[k], is_mlp, rope))
                       for k in range(self.tp)]  # (B, T, dim) partial sums
            if config.desync_reduces(j):
                r = sum(y + s / self.tp for y, s in zip(outputs, streams))
                streams = [r] * self.tp
            else:
                streams = [s + y for s, y in zip(streams, outputs)]
        return model.output(model.norm(streams[0]))  # the last module is always reduced: one stream
