"""Ladder-Residual Llama for transformers (Zhang et al., ICML 2025), written by ladder into its model folders.

Load it with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`. The building blocks
are transformers' own Llama attention, MLP, RMSNorm and rotary embedding, under the same parameter names
as a Llama checkpoint; what a layout changes is when each module's output joins the residual stream,
and that is one loop, `LadderLlamaModel._residual_stream`.

Layouts: standard, parallel, ladder, and hybrid (ladder on the last N layers). Desync and upper-bound
are refused: their streams differ per tensor-parallel rank (each rank adds its own partial outputs
between all-reduces), so they are defined only for a TP degree and a sharding, which ladder runs.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaPreTrainedModel, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)
from transformers.utils import can_return_tuple

from .configuration_ladder_llama import LadderLlamaConfig

# transformers 5.24 renamed the KV cache `past_key_values` to `cache` in forwards and outputs (the old
# argument name works, with a warning, until 5.40). These follow the installed version (>= 5.17).
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"

ATTENTION, MLP, PARALLEL = "attention", "mlp", "parallel"


class LadderLlamaDecoderLayer(GradientCheckpointingLayer):
    """One layer's attention and MLP, each under its RMSNorm (one shared norm in the parallel layout).

    `forward` runs one module on the residual it is given and returns that module's output alone: when
    the output joins the residual stream is the layout's business (`LadderLlamaModel._residual_stream`).
    A call per module also makes gradient checkpointing recompute one module at a time."""

    def __init__(self, config: LadderLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.residual_layout != PARALLEL:
            self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, module: str = ATTENTION,
                **attention_kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, attention weights or None) of `module`: "attention", "mlp", or "parallel" (both on one norm)."""
        if module == MLP:
            return self.mlp(self.post_attention_layernorm(hidden_states)), None
        normed = self.input_layernorm(hidden_states)
        attention, weights = self.self_attn(normed, **attention_kwargs)
        if module == PARALLEL:
            return attention + self.mlp(normed), weights
        return attention, weights


class LadderLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = LadderLlamaConfig
    config: LadderLlamaConfig
    _no_split_modules = ["LadderLlamaDecoderLayer"]
    _can_record_outputs = {}  # hidden states and attentions are collected by the residual loop itself


class LadderLlamaModel(LadderLlamaPreTrainedModel):
    def __init__(self, config: LadderLlamaConfig) -> None:
        if config.residual_layout in ("desync", "upper-bound"):
            raise ValueError(
                f"residual_layout {config.residual_layout!r} cannot run in transformers: each tensor-parallel rank "
                "keeps its own residual stream, so the model is defined only for its TP degree and sharding; "
                "run it with ladder (`ladder generate --model <folder> --tp N`)")
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(LadderLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def modules_in_order(self) -> list[tuple[LadderLlamaDecoderLayer, str]]:
        """The residual modules h_0, h_1, ... in execution order: (layer, "attention"), (layer, "mlp") per
        layer, or one (layer, "parallel") per layer in the parallel layout."""
        if self.config.residual_layout == PARALLEL:
            return [(layer, PARALLEL) for layer in self.layers]
        return [(layer, module) for layer in self.layers for module in (ATTENTION, MLP)]

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        cache: Cache | None = kwargs.pop("cache", None)
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False  # the recompute would write the cache twice
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen).unsqueeze(0)
        attention_kwargs = {
            "attention_mask": create_causal_mask(self.config, inputs_embeds, attention_mask, cache,
                                                 position_ids=position_ids),
            "position_embeddings": self.rotary_emb(inputs_embeds, position_ids=position_ids),
            "position_ids": position_ids, CACHE_ARG: cache, "use_cache": use_cache, **kwargs}

        def run(layer: LadderLlamaDecoderLayer, module: str, r: torch.Tensor) -> torch.Tensor:
            y, weights = layer(r, module=module, **attention_kwargs)
            if attentions is not None and module != MLP:
                attentions.append(weights)
            return y

        hidden_states = [] if _flag(output_hidden_states, self.config.output_hidden_states) else None
        attentions = [] if _flag(output_attentions, self.config.output_attentions) else None
        r = self.norm(self._residual_stream(inputs_embeds, run, hidden_states))
        if hidden_states is not None:
            hidden_states.append(r)  # as in transformers' Llama: the last entry is the normed output
        return BaseModelOutputWithPast(last_hidden_state=r, hidden_states=_tuple(hidden_states),
                                       attentions=_tuple(attentions), **{CACHE_FIELD: cache})

    def _residual_stream(self, r: torch.Tensor, run: Callable[[LadderLlamaDecoderLayer, str, torch.Tensor], torch.Tensor],
                         hidden_states: list[torch.Tensor] | None) -> torch.Tensor:
        """The residual stream after every module. Number the modules h_0, h_1, ... (A_0, M_0, A_1, ...):

            standard module j reads r_{j-1}:       ladder module j reads r_{j-2}:
                r --> h_j --> (+) --> r                r_{j-2} --> h_j ......................
                |              ^                       r_{j-1} --> h_{j+1} ...........      :
                +--------------+                                 r_j = r_{j-1} + y_j <......:
                                                                  h_{j+2}(r_j) ...

        `pending` holds the outputs not yet added to r, oldest first. Before a ladder module all but the
        newest are added (it reads the residual one module stale); before a standard module, all. Under
        tensor parallelism each output is an all-reduce, and the newest one, which a ladder module does not
        wait for, runs while that module computes: the speed-up. On one device only the order of additions
        remains, and it is the same as in ladder's own model, so the two agree. A hybrid is this loop with
        ladder modules in its last N layers only: the first ladder attention reads the residual without
        the previous standard layer's MLP output.
        """
        modules = self.modules_in_order()
        per_layer = len(modules) // len(self.layers)
        first_ladder_module = per_layer * self.config.first_ladder_layer
        pending: list[torch.Tensor] = []
        for j, (layer, module) in enumerate(modules):
            if hidden_states is not None and j % per_layer == 0:  # as Llama's: each layer's input, all added
                hidden_states.append(sum(pending, r) if pending else r)
            stale = j >= first_ladder_module
            while len(pending) > (1 if stale else 0):
                r = r + pending.pop(0)
            pending.append(run(layer, module, r))
        for y in pending:
            r = r + y
        return r


def _flag(value: bool | None, default: bool) -> bool:
    return default if value is None else bool(value)


def _tuple(values: list[torch.Tensor] | None) -> tuple[torch.Tensor, ...] | None:
    return None if values is None else tuple(values)


class LadderLlamaForCausalLM(LadderLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LadderLlamaConfig) -> None:
        super().__init__(config)
        self.model = LadderLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        """As `LlamaForCausalLM.forward`: logits of the last `logits_to_keep` positions (0: all), and the
        shifted cross-entropy when `labels` are given."""
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, kept, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions, **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)})


__all__ = ["LadderLlamaForCausalLM", "LadderLlamaModel", "LadderLlamaPreTrainedModel"]
