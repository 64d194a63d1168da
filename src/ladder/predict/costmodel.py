"""`ladder predict`: a roofline cost model of tensor-parallel generation, per residual layout.

Each module (attention or MLP) of one rank costs
    c = max(bytes / (eta_mem * HBM), flops / (eta_flop * peak)) + module_overhead
where bytes are its weight shard (+ the KV cache it reads) and flops its matmuls (+ attention), and
each all-reduce costs the link model's latency + ring traffic / bandwidth (`ladder.comm.links`).
Per layer, standard pays c_attn + a + c_mlp + a; parallel c_attn + c_mlp - s + a, where s is the part of a
module's fixed cost saved by normalising one input for both modules; upper bound c_attn + c_mlp;
ladder overlaps each all-reduce with the next module: max(c_j, a_{j-1}) + rho * min(c_j, a_{j-1}), where
rho is the part of the overlap lost to interference (NCCL kernels take SMs from the matmuls).
Generation = prefill of the prompt + one decode step per new token at growing context; tokens/s =
batch * gen_len / total time, as in the paper's protocol.

The free constants are the bounded least-squares fit (to convergence) of part of the paper's
Llama-3-70B H100 table (`ladder.predict.paper`), stored in data/costmodel-fit.json; `ladder.predict.fit`
fits them and judges the model on the rest of the table, on a shape it never saw (the paper's
Llama-3-8B speedups at TP 8) and on its Llama-3.1-405B speedups at TP 16 on two nodes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import Any

import torch

from ladder.bench.summary import hidden_fraction
from ladder.comm.links import LinkModel
from ladder.errors import LadderError
from ladder.model.config import ModelConfig, ShardShape, check_hybrids, get_preset, layout_variants
from ladder.quant.quantize import bytes_per_weight, quantizes_head
from ladder.runtime.memory import estimate_memory_bytes, fits_in, kv_cache_bytes


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense
    memory_bytes: int  # what the driver reports (nvidia-smi memory.total)
    source: str


MIB = 2 ** 20
GPUS = {
    "h100": GPU("h100", 3.35e12, 989e12, 81559 * MIB, "NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s "
                "dense BF16; nvidia-smi on an H100 80GB HBM3: 81559 MiB"),
    "h200": GPU("h200", 4.8e12, 989e12, 143771 * MIB, "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s "
                "dense BF16; nvidia-smi on an H200: 143771 MiB"),
    "a100": GPU("a100", 2.039e12, 312e12, 81920 * MIB, "NVIDIA A100 SXM 80GB datasheet: 2.039 TB/s, 312 TFLOP/s "
                "BF16; nvidia-smi on an A100-SXM4-80GB: 81920 MiB"),
}

P2P_LINKS = {"on": "nvlink-h100", "off": "pcie-no-p2p"}  # the paper's two conditions


def get_gpu(name: str, memory_tbps: float | None = None, tflops: float | None = None,
            memory_gib: float | None = None) -> GPU:
    """The GPU of `--gpu`: a preset (its numbers overridden where given), or `custom` from the three
    numbers (HBM bandwidth in TB/s, dense BF16 TFLOP/s, memory in GiB)."""
    given = {"--gpu-memory-tbps": memory_tbps, "--gpu-tflops": tflops, "--gpu-memory-gib": memory_gib}
    for flag, value in given.items():
        if value is not None and value <= 0:
            raise LadderError(f"{flag} must be > 0, got {value:g}")
    if name == "custom":
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise LadderError(f"--gpu custom needs {', '.join(missing)}")
        return GPU("custom", memory_tbps * 1e12, tflops * 1e12, int(memory_gib * 2**30), "given on the command line")
    if name not in GPUS:
        raise LadderError(f"unknown gpu {name!r}; known: {', '.join(GPUS)}, custom")
    gpu = GPUS[name]
    if all(value is None for value in given.values()):
        return gpu
    return replace(gpu, name=gpu.name + "*", source=gpu.source + " (overridden)",
                   hbm_bytes_per_s=gpu.hbm_bytes_per_s if memory_tbps is None else memory_tbps * 1e12,
                   bf16_flops_per_s=gpu.bf16_flops_per_s if tflops is None else tflops * 1e12,
                   memory_bytes=gpu.memory_bytes if memory_gib is None else int(memory_gib * 2**30))


@dataclass(frozen=True)
class CostConstants:
    """The model's free constants. These defaults are where the fit starts; the fitted ones are in
    data/costmodel-fit.json (`fitted_constants()`)."""
    mem_efficiency: float = 0.7  # fraction of HBM bandwidth decode matmuls achieve
    attention_efficiency: float = 0.3  # fraction of HBM bandwidth decode attention achieves on the KV cache
    flop_efficiency: float = 0.6  # fraction of peak prefill matmuls achieve
    module_overhead_us: float = 5.0  # fixed cost of a module (norm, small kernels, launch gaps)
    step_overhead_us: float = 100.0  # fixed cost of a decode step (head, sampling, graph launch)
    overlap_penalty: float = 0.2  # rho at batch 1: fraction of the overlapped shorter side not hidden
    overlap_penalty_growth: float = 0.05  # rho grows by this per doubling of the batch (more NCCL SMs)
    # parallel normalises one input for both modules of a layer (layouts.md): the part of a module's
    # fixed cost it saves per layer. Without it, parallel's speedup came out 0.02-0.06 low at TP 8 in the fit.
    shared_norm_fraction: float = 0.3


@dataclass(frozen=True)
class Workload:
    config: ModelConfig
    tp: int
    batch_size: int
    prompt_len: int = 1024
    gen_len: int = 512
    dtype_bytes: int = 2
    ladder_layers: int | None = None  # the ladder layout: on the last N layers only (hybrid); None: all
    quantize: str | None = None  # weight-only int8 (and head) or int4 block linears: fewer bytes a step

    @property
    def linear_weight_bytes(self) -> float:
        """Bytes a step reads per block-linear weight."""
        return bytes_per_weight(self.quantize, self.dtype_bytes)

    @property
    def head_weight_bytes(self) -> float:
        """Bytes a step reads per output-head weight: int8 quantizes the head too, int4 does not."""
        return self.linear_weight_bytes if quantizes_head(self.quantize) else self.dtype_bytes


def _t(x: float | torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


MODELLED_LAYOUTS = ("standard", "parallel", "upper-bound", "ladder")  # (and hybrid, as ladder; desync is not modelled)


def interference(k: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """rho: the fraction of the shorter side of an overlap that is not hidden (NCCL kernels take SMs
    from the matmuls), growing with the batch."""
    return torch.clamp(k["overlap_penalty"] + k["overlap_penalty_growth"] * torch.log2(batch), max=1.0)


def prefill_interference(k: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """rho in the prefill: the decode's (a dropped variant gives the prefill its own constant,
    experiments/costmodel/variants.py)."""
    return interference(k, batch)


def overlapped(compute: torch.Tensor, all_reduce: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """Time of a module's compute run beside an all-reduce: the longer side, plus the lost part of the other."""
    return torch.maximum(compute, all_reduce) + rho * torch.minimum(compute, all_reduce)


def predict_seconds(w: Workload, layout: str, gpu: GPU, link: LinkModel, k: dict[str, torch.Tensor]
                    ) -> torch.Tensor:
    """Predicted prefill + decode time (s) of one generation. `k`: the constants as tensors."""
    return predict_seconds_of([w], [layout], gpu, [link], k)[0]


def predict_seconds_of(workloads: Sequence[Workload], layouts: Sequence[str], gpu: GPU, links: Sequence[LinkModel],
                       k: dict[str, torch.Tensor]) -> torch.Tensor:
    """`predict_seconds` of many generations of one model shape at once, as a tensor: the fit
    evaluates all its rows at each of its steps."""
    c, by = _one_shape(workloads, layouts)
    wb, head_wb = workloads[0].linear_weight_bytes, workloads[0].head_weight_bytes
    rows = _Rows.of(workloads, links)
    hd = c.head_dim
    attn_params = (c.dim * (rows.heads + 2 * rows.kv_heads) * hd + rows.heads * hd * c.dim)
    mlp_params = 3 * c.dim * c.ffn_hidden / rows.tp
    head_params = c.vocab_size * c.dim  # replicated output head
    mem_bw = k["mem_efficiency"] * gpu.hbm_bytes_per_s
    flops = k["flop_efficiency"] * gpu.bf16_flops_per_s
    module_s, step_s = k["module_overhead_us"] * 1e-6, k["step_overhead_us"] * 1e-6
    shared_norm_s = k["shared_norm_fraction"] * module_s
    b, prompt_len, gen_len = rows.batch, rows.prompt_len, rows.gen_len

    def roof(n_bytes, n_flops):
        return torch.maximum(_t(n_bytes) / mem_bw, _t(n_flops) / flops) + module_s

    def combine(c_attn, c_mlp, a, rho):
        return _each_rows_layout(layouts, c.n_layers, rows.ladder_n, c_attn, c_mlp, a, rho, shared_norm_s)

    # prefill: b * P tokens at once (compute-bound), causal attention over P
    n = b * prompt_len
    pre_attn = roof(wb * attn_params, 2 * n * attn_params + 2 * b * rows.heads * prompt_len ** 2 * hd)
    pre_mlp = roof(wb * mlp_params, 2 * n * mlp_params)
    prefill = (combine(pre_attn, pre_mlp, rows.prefill_all_reduce, prefill_interference(k, b))
               + roof(head_wb * head_params, 2 * n * head_params))

    # decode: one token per sequence. Like gpt-fast, the engine attends over the whole static cache
    # (prompt + gen positions, masked), so every step reads all of it.
    cache_len = prompt_len + gen_len
    kv_bytes = kv_cache_bytes(c, rows.kv_heads, b, cache_len, by, layers=1)  # one layer, this rank's heads
    kv_s = kv_bytes / (k["attention_efficiency"] * gpu.hbm_bytes_per_s)
    dec_attn = roof(wb * attn_params, 2 * b * attn_params) + kv_s
    dec_mlp = roof(wb * mlp_params, 2 * b * mlp_params)
    step = (combine(dec_attn, dec_mlp, rows.decode_all_reduce, interference(k, b))
            + roof(head_wb * head_params, 2 * b * head_params) + step_s)
    return prefill + gen_len * step


def _one_shape(workloads: Sequence[Workload], layouts: Sequence[str]) -> tuple[ModelConfig, int]:
    for layout in layouts:
        if layout not in MODELLED_LAYOUTS:
            raise LadderError(f"the cost model knows standard, parallel, ladder and upper-bound, not {layout!r}")
    c, by = workloads[0].config, workloads[0].dtype_bytes
    if any(w.config != c or w.dtype_bytes != by or w.quantize != workloads[0].quantize for w in workloads):
        raise ValueError("predict_seconds_of takes workloads of one model shape, dtype and quantization")
    return c, by


def _column(values: Iterable[float]) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


@dataclass(frozen=True)
class _Rows:
    """The numbers of each row (workload) as float64 columns."""

    tp: torch.Tensor
    batch: torch.Tensor
    prompt_len: torch.Tensor
    gen_len: torch.Tensor
    ladder_n: torch.Tensor  # layers on ladder
    heads: torch.Tensor  # query heads of the busiest rank (rank 0: `ShardShape`)
    kv_heads: torch.Tensor
    prefill_all_reduce: torch.Tensor  # seconds of one all-reduce (the link is fixed, not fitted)
    decode_all_reduce: torch.Tensor

    @staticmethod
    def of(workloads: Sequence[Workload], links: Sequence[LinkModel]) -> _Rows:
        c, by = workloads[0].config, workloads[0].dtype_bytes
        shards = [ShardShape.of(c, 0, w.tp) for w in workloads]
        pairs = list(zip(workloads, links, strict=True))
        return _Rows(
            tp=_column(w.tp for w in workloads), batch=_column(w.batch_size for w in workloads),
            prompt_len=_column(w.prompt_len for w in workloads), gen_len=_column(w.gen_len for w in workloads),
            ladder_n=_column(c.n_layers if w.ladder_layers is None else w.ladder_layers for w in workloads),
            heads=_column(s.n_heads for s in shards), kv_heads=_column(s.n_kv_heads for s in shards),
            prefill_all_reduce=_column(link.all_reduce_s(w.batch_size * w.prompt_len * c.dim * by, w.tp)
                                       for w, link in pairs),
            decode_all_reduce=_column(link.all_reduce_s(w.batch_size * c.dim * by, w.tp) for w, link in pairs))


def _each_rows_layout(layouts: Sequence[str], n_layers: int, ladder_n: torch.Tensor, c_attn: torch.Tensor,
                      c_mlp: torch.Tensor, a: torch.Tensor, rho: torch.Tensor, shared_norm_s: torch.Tensor
                      ) -> torch.Tensor:
    """All layers' time in each row's layout, from one layer's module costs and all-reduce `a`.
    Ladder: only the last all-reduce is exposed. Hybrid (ladder on the last N layers): the standard
    layers pay theirs, but the first ladder attention overlaps the last standard MLP's all-reduce,
    which stands in for the exposed last one."""
    L = n_layers
    whole = (ladder_n == L).double()
    by_layout = {"standard": L * (c_attn + c_mlp + 2 * a),
                 "parallel": L * (c_attn + c_mlp - shared_norm_s + a),
                 "upper-bound": L * (c_attn + c_mlp),
                 "ladder": ((L - ladder_n) * (c_attn + c_mlp + 2 * a)
                            + ladder_n * (overlapped(c_attn, a, rho) + overlapped(c_mlp, a, rho)) + whole * a)}
    chosen = torch.tensor([MODELLED_LAYOUTS.index(layout) for layout in layouts])[None]
    return torch.stack([by_layout[name].expand(len(layouts)) for name in MODELLED_LAYOUTS]).gather(0, chosen)[0]


Constants = CostConstants | Mapping[str, float]  # (a mapping: a variant's own constants, experiments/costmodel/variants.py)
LinkOf = Callable[[str], LinkModel]  # a link preset's name -> the link model that stands for it


def constant_values(constants: Constants) -> dict[str, float]:
    return asdict(constants) if isinstance(constants, CostConstants) else dict(constants)


def constant_tensors(constants: Constants) -> dict[str, torch.Tensor]:
    """The constants as the model computes with them (float64 tensors, for autograd in the fit)."""
    return {name: _t(v) for name, v in constant_values(constants).items()}


def predict_tokens_per_s(w: Workload, layout: str, gpu: GPU, link: LinkModel, constants: Constants) -> float:
    k = constant_tensors(constants)
    return w.batch_size * w.gen_len / float(predict_seconds(w, layout, gpu, link, k))


def predicted_speedup(w: Workload, layout: str, gpu: GPU, link: LinkModel, constants: Constants) -> float:
    """Predicted tokens/s of `layout` over standard's."""
    return (predict_tokens_per_s(w, layout, gpu, link, constants)
            / predict_tokens_per_s(w, "standard", gpu, link, constants))


FITTED_FILE = "data/costmodel-fit.json"


def stored_fit() -> dict[str, Any]:
    """costmodel-fit.json: the constants, their held-out validation and the unseen settings' reports."""
    return json.loads(resources.files("ladder").joinpath(FITTED_FILE).read_text())


def fitted_constants() -> CostConstants:
    """The stored result of `ladder.predict.fit.fit_on_paper()` (written by experiments/costmodel/fit.py,
    checked by a test)."""
    return CostConstants(**stored_fit()["constants"])


def predict_table(preset: str, gpu: GPU, link: LinkModel, tp: int, batch_sizes: list[int],
                  layouts: list[str], prompt_len: int, gen_len: int,
                  constants: CostConstants | None = None, ladder_layers: Sequence[int] | None = None,
                  config: ModelConfig | None = None, quantize: str | None = None) -> list[dict[str, Any]]:
    """Predicted tokens/s for each (batch, layout): in all, per GPU, the speedup over standard and,
    for ladder, the share of standard's communication it hides (the paper's definition, as `ladder
    bench` reports it). `ladder_layers`: instead of whole ladder, a hybrid (ladder on the last N layers
    only) for each N. `config`: a shape that is no preset's (a checkpoint's), `preset` its label.
    `memory_bytes_per_gpu` is `ladder bench`'s estimate of one rank's peak, and
    `fits` whether that stays within the share of the GPU's memory `ladder bench` allows itself: the
    roofline knows no memory limit, so a row that does not fit predicts a run that cannot happen."""
    constants = constants or fitted_constants()
    config = config or get_preset(preset)
    config.check_tp(tp)
    if min(batch_sizes) < 1 or prompt_len < 1 or gen_len < 1:
        raise LadderError("batch sizes, --prompt-len and --gen-len must be >= 1")
    check_hybrids(ladder_layers, layouts)
    outside = [n for n in ladder_layers or [] if not 0 <= n <= config.n_layers]
    if outside:
        raise LadderError(f"--ladder-layers must be between 0 and {preset}'s {config.n_layers} layers, "
                          f"got {outside[0]}")
    variants = layout_variants(layouts, ladder_layers)
    rows = []
    for b in batch_sizes:
        w = Workload(config, tp, b, prompt_len, gen_len, quantize=quantize)
        memory = estimate_memory_bytes(config, tp, b, prompt_len, prompt_len + gen_len, w.dtype_bytes,
                                       quantize=quantize)
        tps = {(name, n): predict_tokens_per_s(replace(w, ladder_layers=n), name, gpu, link, constants)
               for name, n in dict.fromkeys([*variants, ("standard", None), ("upper-bound", None)])}
        seconds = {variant: 1 / value for variant, value in tps.items()}  # per generated token: hidden's times
        standard, upper_bound = ("standard", None), ("upper-bound", None)
        for layout, n in variants:
            hidden = (hidden_fraction(seconds[standard], seconds[(layout, n)], seconds[upper_bound])
                      if layout == "ladder" else None)
            rows.append({"preset": preset, "gpu": gpu.name, "interconnect": link.name, "tp": tp, "batch_size": b,
                         "layout": layout, "ladder_layers": n, "quantize": quantize, "tokens_per_s": tps[(layout, n)],
                         "tokens_per_s_per_gpu": tps[(layout, n)] / tp, "speedup": tps[(layout, n)] / tps[standard],
                         "hidden": hidden, "memory_bytes_per_gpu": memory, "fits": fits_in(memory, gpu.memory_bytes)})
    return rows


