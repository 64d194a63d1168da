"""A Ladder-Residual Llama built from vLLM's own layers (imported by vLLM, through `register()`, only).

Everything but the residual stream is vLLM's: its parallel linears, paged attention and KV cache,
RMSNorm, rotary embedding, vocabulary-parallel embedding and head, sampler, weight loading and
pipeline stages. What ladder owns is what vLLM cannot express, the schedule of the all-reduces: the
row-parallel projections return partial sums (`reduce_results=False`), and the layer loop launches
each all-reduce through a ladder `Communicator` on vLLM's TP group without waiting, and waits only
where the layout needs the sum: `ladder.model.schedule.ladder_residual`, the function ladder's own
model runs.

On CPU, vLLM compiles the model (its DYNAMO_TRACE_ONCE mode, inductor) unless told `--enforce-eager`,
with settings that ladder's own compiled step uses too: inductor's `reorder_for_locality` off (it would
move each all-reduce launch down to its wait, and the overlap with it), and `ladder.cpu.inductor_fix` (torch
2.13's CPU fusion read a ladder module's output before vLLM's linear layer had written it); and one of
its own, the CPP backend's horizontal fusion off (`prepare_inductor`). On
CUDA it runs eager: vLLM's piecewise CUDA graphs around ladder's collectives have not run on a GPU. The
start-up line says which.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode, VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size, get_tp_group
from vllm.logger import init_logger
from vllm.model_executor.layers import linear as vllm_linear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models import llama as vllm_llama
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (AutoWeightsLoader, PPMissingLayer, make_layers, maybe_prefix)
from vllm.sequence import IntermediateTensors

from ladder.comm.base import Communicator, Done, Handle, LocalCommunicator
from ladder.comm.distributed import TorchCommunicator
from ladder.comm.emulated import EmulatedCommunicator, trace_emulated_launches
from ladder.comm.links import get_link
from ladder.cpu.inductor_fix import keep_mutation_renames
from ladder.errors import LadderError
from ladder.model.schedule import ModuleStep, ladder_residual
from ladder.remote_code.configuration_ladder_llama import LadderLlamaConfig
from ladder.vllm_plugin.config import check_layout, layout_of

logger = init_logger("vllm.ladder")  # under vLLM's logger, so its handlers print it


@contextlib.contextmanager
def emulated_tensor_parallel(world_size: int) -> Iterator[None]:
    """Build vLLM's parallel layers as rank 0 of `world_size` ranks inside a one-rank vLLM: the layers
    read the TP degree from these two functions when they are built, and shard their weights by it."""
    targets = [vllm_llama, vllm_linear]
    saved = [(m, vars(m).get("get_tensor_model_parallel_world_size"), vars(m).get("get_tensor_model_parallel_rank"))
             for m in targets]
    for module in targets:
        module.get_tensor_model_parallel_world_size = lambda: world_size
        module.get_tensor_model_parallel_rank = lambda: 0
    try:
        yield
    finally:
        for module, size, rank in saved:
            for name, original in (("get_tensor_model_parallel_world_size", size), ("get_tensor_model_parallel_rank", rank)):
                if original is None:
                    delattr(module, name)
                else:
                    setattr(module, name, original)


def communicator(vllm_config: VllmConfig) -> tuple[Communicator, int | None]:
    """The communicator of this worker, and the emulated TP degree (None: vLLM's real TP group)."""
    settings = (vllm_config.additional_config or {}).get("ladder", {}) if isinstance(
        vllm_config.additional_config, dict) else {}
    unknown = set(settings) - {"interconnect", "tp", "link_scale"}
    if unknown:
        raise LadderError(f"unknown ladder setting(s) in --additional-config: {', '.join(sorted(unknown))}; "
                          "known: interconnect, tp, link_scale")
    link = get_link(str(settings.get("interconnect", "real")))  # None: "real", vLLM's own TP group
    if link is not None:
        tp = int(settings.get("tp", 0))
        if get_tensor_model_parallel_world_size() != 1 or tp < 2:
            raise LadderError("an emulated interconnect runs in a one-rank vLLM (tensor_parallel_size 1) and "
                              f"needs the emulated degree as \"tp\" >= 2 (got tensor_parallel_size "
                              f"{get_tensor_model_parallel_world_size()}, tp {settings.get('tp')})")
        device = torch.device(vllm_config.device_config.device)
        return EmulatedCommunicator(link, tp, device, float(settings.get("link_scale", 1.0))), tp
    if get_tensor_model_parallel_world_size() == 1:
        return LocalCommunicator(), None
    return TorchCommunicator(get_tp_group().device_group), None


class LadderDecoderLayer(nn.Module):
    """vLLM's Llama attention and MLP, each returning its partial sum: the all-reduce is the layer
    loop's business. The parallel layout shares one norm between the two."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LadderLlamaConfig = vllm_config.model_config.hf_config
        self.self_attn = vllm_llama.LlamaAttention(
            config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
            quant_config=vllm_config.quant_config, bias=config.attention_bias, bias_o_proj=config.attention_bias,
            cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn")
        self.self_attn.o_proj.reduce_results = False  # a partial sum: ladder's loop reduces it
        self.mlp = vllm_llama.LlamaMLP(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act, quant_config=vllm_config.quant_config, bias=config.mlp_bias,
            prefix=f"{prefix}.mlp", reduce_results=False)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layout_of(config)[0] != "parallel":
            self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attention(self, positions: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions=positions, hidden_states=self.input_layernorm(r))

    def feed_forward(self, r: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(r))

    def parallel(self, positions: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        u = self.input_layernorm(r)
        return self.self_attn(positions=positions, hidden_states=u) + self.mlp(u)


def residual_steps(layers: list[LadderDecoderLayer], start: int, positions: torch.Tensor) -> Iterator[tuple[int, ModuleStep]]:
    """The layers' modules in execution order, as `ladder_residual` steps: add what arrived, then the module."""
    def step(branch: Callable[[torch.Tensor], torch.Tensor]) -> ModuleStep:
        def add_then_run(r: torch.Tensor, arrived: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            r = r if arrived is None else r + arrived
            return r, branch(r)
        return add_then_run

    for i, layer in enumerate(layers, start=start):
        yield 2 * i, step(functools.partial(layer.attention, positions))
        yield 2 * i + 1, step(layer.feed_forward)


def compiled_by_vllm(vllm_config: VllmConfig) -> bool:
    """Whether vLLM compiles the model: on CPU, unless `--enforce-eager` (see the module's docstring)."""
    return (vllm_config.compilation_config.mode != CompilationMode.NONE
            and vllm_config.device_config.device_type == "cpu")


def prepare_inductor(vllm_config: VllmConfig) -> None:
    """Before vLLM compiles: keep each all-reduce's launch where ladder put it, let an emulated link trace,
    and keep inductor's CPU fusion from reading a linear layer's output before vLLM's op writes it: the
    fix for the bug found (`ladder.cpu.inductor_fix`), and no horizontal fusion in the CPP backend, where a
    second case (a 10-layer hybrid in two pipeline stages) gave wrong tokens with the fix alone."""
    options = vllm_config.compilation_config.inductor_compile_config
    options["reorder_for_locality"] = False
    options["cpp.max_horizontal_fusion_size"] = 1
    trace_emulated_launches()
    keep_mutation_renames()


# (the dynamic dimensions named: vLLM finds them from annotations, which are strings in this module)
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0}, enable_if=compiled_by_vllm)
class LadderLlamaModel(nn.Module):
    """The decoder on one TP rank and pipeline stage. Pipeline stages hand on the residual stream and
    the newest module output not yet added to it (`pending`), its all-reduce waited for: the next stage
    then continues the ladder recurrence exactly where this one stopped."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LadderLlamaConfig = vllm_config.model_config.hf_config
        self.layout, self.first_ladder_layer = layout_of(config)
        check_layout(self.layout)
        self.config = config
        self.comm, emulated_tp = communicator(vllm_config)
        if compiled_by_vllm(vllm_config):
            prepare_inductor(vllm_config)
        pp = get_pp_group()
        if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank):
            # (emulated: the whole vocabulary on the one rank, as ladder's own emulation keeps it)
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                       quant_config=vllm_config.quant_config)
        else:
            self.embed_tokens = PPMissingLayer()
        with emulated_tensor_parallel(emulated_tp) if emulated_tp else contextlib.nullcontext():
            self.start_layer, self.end_layer, self.layers = make_layers(
                config.num_hidden_layers, lambda prefix: LadderDecoderLayer(vllm_config, prefix),
                prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                        device: torch.device) -> IntermediateTensors:
        return IntermediateTensors({name: torch.zeros((batch_size, self.config.hidden_size), dtype=dtype,
                                                      device=device) for name in ("hidden_states", "pending")})

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        pending: list[Handle] = []
        if get_pp_group().is_first_rank:
            r = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)  # (T, dim)
        else:
            assert intermediate_tensors is not None
            r = intermediate_tensors["hidden_states"]
            # the previous stage's newest output, reduced and not yet added: the first module here reads the
            # stream the layout says it reads (parallel and upper bound add every output at once: zeros)
            pending.append(Done(intermediate_tensors["pending"]))
        layers = list(islice(self.layers, self.start_layer, self.end_layer))
        if self.layout == "parallel":
            r = self._parallel_layers(r, positions, layers)
        elif self.layout == "upper-bound":
            r = self._unreduced_layers(r, positions, layers)
        else:
            r, pending = self._ladder_layers(r, positions, layers, pending)
        if not get_pp_group().is_last_rank:
            # hand on the stream and the output the next stage's first module must not read yet
            newest = pending[-1].wait() if pending else torch.zeros_like(r)
            return IntermediateTensors({"hidden_states": r, "pending": newest})
        return self.norm(r)

    def _ladder_layers(self, r: torch.Tensor, positions: torch.Tensor, layers: list[LadderDecoderLayer],
                       pending: list[Handle]) -> tuple[torch.Tensor, list[Handle]]:
        """Standard, ladder and hybrid: the ladder recurrence, the very function ladder's own model runs
        (`ladder.model.schedule.ladder_residual`). A stage boundary hands the newest output on, unadded."""
        return ladder_residual(r, residual_steps(layers, self.start_layer, positions), self.comm,
                               2 * self.first_ladder_layer, 2 * self.config.num_hidden_layers, nothing=None,
                               pending=pending, hand_on=0 if get_pp_group().is_last_rank else 1)

    def _parallel_layers(self, r: torch.Tensor, positions: torch.Tensor,
                         layers: list[LadderDecoderLayer]) -> torch.Tensor:
        """GPT-J / PaLM: r = r + AR(A(u) + M(u)), u = norm(r): one blocking all-reduce per layer."""
        for layer in layers:
            r = r + self.comm.all_reduce(layer.parallel(positions, r))
        return r

    def _unreduced_layers(self, r: torch.Tensor, positions: torch.Tensor,
                          layers: list[LadderDecoderLayer]) -> torch.Tensor:
        """Upper bound: nothing is reduced, each rank adds its own partial sums. Not a valid model at
        TP > 1 (its tokens are meaningless), only the speed with no communication at all."""
        for layer in layers:
            r = r + layer.attention(positions, r)
            r = r + layer.feed_forward(r)
        return r

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=vllm_llama.LlamaModel.hf_to_vllm_mapper)


class LadderLlamaForCausalLM(nn.Module, SupportsPP):
    """vLLM's causal-LM wrapper around `LadderLlamaModel`: its head, logits processor and weight names are
    `LlamaForCausalLM`'s, so a ladder folder's safetensors load as a Llama folder's do."""

    packed_modules_mapping = vllm_llama.LlamaForCausalLM.packed_modules_mapping

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LadderLlamaConfig = vllm_config.model_config.hf_config
        self.config = config
        self.model = LadderLlamaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        if get_tp_group().rank_in_group == 0 and get_pp_group().is_first_rank:
            logger.info("ladder: %s", describe(config, self.model.comm, compiled_by_vllm(vllm_config)))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)


def describe(config: LadderLlamaConfig, comm: Communicator, compiled: bool) -> str:
    """The start-up line: the layout, how its all-reduces run, and whether vLLM compiles it."""
    n = config.num_hidden_layers
    layout, first = layout_of(config)
    if layout == "ladder" and first > 0:
        layout = f"hybrid (ladder on the last {n - first} of {n} layers)"
    if isinstance(comm, EmulatedCommunicator):
        how = (f"emulated {comm.link.name} at TP {comm.world_size} (x{comm.scale:g}): rank 0's shard, each "
               "all-reduce a wait of the modelled duration")
    elif comm.world_size > 1:
        how = f"TP {comm.world_size}: all-reduces launched asynchronously on vLLM's TP group, waited where the layout needs them"
    else:
        how = "TP 1: no all-reduce"
    mode = ("compiled by vLLM (inductor, all-reduce launches kept in place)" if compiled else
            "eager (--enforce-eager; on CUDA always: docs/vllm.md)")
    return f"{layout} layout, {how}; {mode}"


__all__ = ["LadderLlamaForCausalLM"]
