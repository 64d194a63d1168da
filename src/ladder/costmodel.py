"""`ladder predict`: a roofline cost model of tensor-parallel generation, per residual layout.

Each module (attention or MLP) of one rank costs
    c = max(bytes / (eta_mem * HBM), flops / (eta_flop * peak)) + module_overhead
where bytes are its weight shard (+ the KV cache it reads) and flops its matmuls (+ attention), and
each all-reduce costs the link model's latency + ring traffic / bandwidth (`ladder.interconnect`).
Per layer, standard pays c_attn + a + c_mlp + a; parallel c_attn + c_mlp - s + a, where s is the part of a
module's fixed cost saved by normalising one input for both modules; upper bound c_attn + c_mlp;
ladder overlaps each all-reduce with the next module: max(c_j, a_{j-1}) + rho * min(c_j, a_{j-1}), where
rho is the part of the overlap lost to interference (NCCL kernels take SMs from the matmuls).
Generation = prefill of the prompt + one decode step per new token at growing context; tokens/s =
batch * gen_len / total time, as in the paper's protocol.

The free constants are the bounded least-squares fit (to convergence) of part of the paper's
Llama-3-70B H100 table (`data/llama3-70b-h100-throughput.csv`); the model is judged on the rest
(`validate()`), on a shape it never saw, the paper's Llama-3-8B speedups at TP 8, and on its
Llama-3.1-405B speedups at TP 16 on two nodes (`validate_unseen()`).
"""

from __future__ import annotations

import csv
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import Any

import torch

from ladder.config import ModelConfig, get_preset
from ladder.errors import LadderError
from ladder.interconnect import LinkModel, link_presets


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


def _t(x: float | torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


MODELLED_LAYOUTS = ("standard", "parallel", "upper-bound", "ladder")  # (and hybrid, as ladder; desync is not modelled)


def interference(k: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """rho: the fraction of the shorter side of an overlap that is not hidden (NCCL kernels take SMs
    from the matmuls), growing with the batch."""
    return torch.clamp(k["overlap_penalty"] + k["overlap_penalty_growth"] * torch.log2(batch), max=1.0)


def prefill_interference(k: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """rho in the prefill: the decode's (a dropped variant gives the prefill its own constant,
    scripts/costmodel_variants.py)."""
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
    evaluates all its rows in each step (one row at a time, fitting took 30 s)."""
    for layout in layouts:
        if layout not in MODELLED_LAYOUTS:
            raise LadderError(f"the cost model knows standard, parallel, ladder and upper-bound, not {layout!r}")
    c, by = workloads[0].config, workloads[0].dtype_bytes
    if any(w.config != c or w.dtype_bytes != by for w in workloads):
        raise ValueError("predict_seconds_of takes workloads of one model shape and dtype")

    def column(values: Iterable[float]) -> torch.Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float64)

    tp, b = column(w.tp for w in workloads), column(w.batch_size for w in workloads)
    prompt_len, gen_len = column(w.prompt_len for w in workloads), column(w.gen_len for w in workloads)
    ladder_n = column(c.n_layers if w.ladder_layers is None else w.ladder_layers for w in workloads)
    # the link is fixed (not fitted): its durations are numbers per row
    prefill_all_reduce = column(link.all_reduce_s(w.batch_size * w.prompt_len * c.dim * by, w.tp)
                                for w, link in zip(workloads, links, strict=True))
    decode_all_reduce = column(link.all_reduce_s(w.batch_size * c.dim * by, w.tp)
                               for w, link in zip(workloads, links, strict=True))
    hd = c.head_dim
    heads, kv = c.n_heads / tp, torch.clamp(c.n_kv_heads / tp, min=1.0)
    attn_params = (c.dim * (heads + 2 * kv) * hd + heads * hd * c.dim)
    mlp_params = 3 * c.dim * c.ffn_hidden / tp
    head_params = c.vocab_size * c.dim  # replicated output head
    mem_bw = k["mem_efficiency"] * gpu.hbm_bytes_per_s
    flops = k["flop_efficiency"] * gpu.bf16_flops_per_s
    module_s, step_s = k["module_overhead_us"] * 1e-6, k["step_overhead_us"] * 1e-6
    shared_norm_s = k["shared_norm_fraction"] * module_s
    chosen = torch.tensor([MODELLED_LAYOUTS.index(layout) for layout in layouts])[None]

    def roof(n_bytes, n_flops):
        return torch.maximum(_t(n_bytes) / mem_bw, _t(n_flops) / flops) + module_s

    def combine(c_attn, c_mlp, a, rho):  # each row's layout
        L = c.n_layers
        # Ladder: only the last all-reduce is exposed. Hybrid (ladder on the last N layers): the standard
        # layers pay theirs, but the first ladder attention overlaps the last standard MLP's all-reduce,
        # which stands in for the exposed last one.
        whole = (ladder_n == L).double()
        by_layout = {"standard": L * (c_attn + c_mlp + 2 * a),
                     "parallel": L * (c_attn + c_mlp - shared_norm_s + a),
                     "upper-bound": L * (c_attn + c_mlp),
                     "ladder": ((L - ladder_n) * (c_attn + c_mlp + 2 * a)
                                + ladder_n * (overlapped(c_attn, a, rho) + overlapped(c_mlp, a, rho)) + whole * a)}
        return torch.stack([by_layout[name].expand(len(layouts)) for name in MODELLED_LAYOUTS]).gather(0, chosen)[0]

    # prefill: b * P tokens at once (compute-bound), causal attention over P
    n = b * prompt_len
    pre_attn = roof(by * attn_params, 2 * n * attn_params + 2 * b * heads * prompt_len ** 2 * hd)
    pre_mlp = roof(by * mlp_params, 2 * n * mlp_params)
    prefill = (combine(pre_attn, pre_mlp, prefill_all_reduce, prefill_interference(k, b))
               + roof(by * head_params, 2 * n * head_params))

    # decode: one token per sequence. Like gpt-fast, the engine attends over the whole static cache
    # (prompt + gen positions, masked), so every step reads all of it.
    cache_len = prompt_len + gen_len
    kv_bytes = 2 * by * b * kv * cache_len * hd  # K and V of this rank's heads
    kv_s = kv_bytes / (k["attention_efficiency"] * gpu.hbm_bytes_per_s)
    dec_attn = roof(by * attn_params, 2 * b * attn_params) + kv_s
    dec_mlp = roof(by * mlp_params, 2 * b * mlp_params)
    step = (combine(dec_attn, dec_mlp, decode_all_reduce, interference(k, b))
            + roof(by * head_params, 2 * b * head_params) + step_s)
    return prefill + gen_len * step


Constants = CostConstants | Mapping[str, float]  # (a mapping: a variant's own constants, scripts/costmodel_variants.py)
LinkOf = Callable[[str], LinkModel]  # a link preset's name -> the link model that stands for it


def _values(constants: Constants) -> dict[str, float]:
    return asdict(constants) if isinstance(constants, CostConstants) else dict(constants)


def predict_tokens_per_s(w: Workload, layout: str, gpu: GPU, link: LinkModel, constants: Constants) -> float:
    k = {name: _t(v) for name, v in _values(constants).items()}
    return w.batch_size * w.gen_len / float(predict_seconds(w, layout, gpu, link, k))


# ---- the paper's table, fitting and validation ------------------------------------------------------

def paper_table() -> list[dict[str, Any]]:
    """The paper's Llama-3-70B H100 throughput rows (tokens/s per layout, TP, batch, P2P)."""
    text = resources.files("ladder").joinpath("data/llama3-70b-h100-throughput.csv").read_text()
    rows = []
    for r in csv.DictReader(text.splitlines()):
        rows.append({"layout": r["layout"].replace("_", "-"), "tp": int(r["tp"]),
                     "batch_size": int(r["batch_size"]), "p2p": r["p2p"], "prompt_len": int(r["prompt_len"]),
                     "gen_len": int(r["gen_len"]), "tokens_per_s": float(r["tokens_per_s"])})
    return rows


def paper_throughputs() -> dict[tuple[str, int, int, str], float]:
    """The paper's tokens/s by (layout, TP, batch, P2P)."""
    return {(r["layout"], r["tp"], r["batch_size"], r["p2p"]): r["tokens_per_s"] for r in paper_table()}


def predicted_speedup(w: Workload, layout: str, gpu: GPU, link: LinkModel, constants: Constants) -> float:
    """Predicted tokens/s of `layout` over standard's."""
    return (predict_tokens_per_s(w, layout, gpu, link, constants)
            / predict_tokens_per_s(w, "standard", gpu, link, constants))


TRAIN_BATCHES = (1, 64)  # fit on the extremes; judge on the batch sizes in between
HELD_OUT_BATCHES = (4, 16)


def _row_workload(r: dict[str, Any]) -> Workload:
    return Workload(get_preset("llama-3-70b"), r["tp"], r["batch_size"], r["prompt_len"], r["gen_len"])


# constants with a range; the others are >= 0
BOUNDS = {"mem_efficiency": (0.05, 1.0), "attention_efficiency": (0.01, 1.0), "flop_efficiency": (0.05, 1.0),
          "overlap_penalty": (0.0, 1.0), "shared_norm_fraction": (0.0, 1.0)}


def _preset_link(name: str) -> LinkModel:
    return link_presets()[name]


def fit(rows: list[dict[str, Any]], gpu: GPU = GPUS["h100"]) -> CostConstants:
    """Least squares on log tokens/s over `rows`, from the default constants."""
    return CostConstants(**fit_constants(rows, asdict(CostConstants()), gpu=gpu))


Residuals = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def log_errors(rows: list[dict[str, Any]], gpu: GPU = GPUS["h100"],
               link_of: LinkOf = _preset_link) -> Residuals:
    """The error of predicted log tokens/s at each row, as a function of the constants (tensors): what
    the fit squares. The rows' workloads and links are looked up once, for the fit's many calls."""
    targets = torch.tensor([math.log(r["tokens_per_s"]) for r in rows], dtype=torch.float64)
    workloads, layouts = [_row_workload(r) for r in rows], [r["layout"] for r in rows]
    links = [link_of(P2P_LINKS[r["p2p"]]) for r in rows]
    tokens = torch.tensor([r["batch_size"] * r["gen_len"] for r in rows], dtype=torch.float64)
    return lambda k: torch.log(tokens / predict_seconds_of(workloads, layouts, gpu, links, k)) - targets


def fit_constants(rows: list[dict[str, Any]], init: Mapping[str, float],
                  bounds: Mapping[str, tuple[float, float]] = BOUNDS, gpu: GPU = GPUS["h100"],
                  link_of: LinkOf = _preset_link, extra_residuals: Residuals | None = None) -> dict[str, float]:
    """The constants that minimise the squared error of log tokens/s over `rows`, within `bounds`,
    starting from `init` (every constant the model reads), each row's link looked up by `link_of`, and
    `extra_residuals(constants)` appended to the rows' if given.

    scipy's bounded trust-region least squares, to convergence, with the model's exact Jacobian
    (autograd). A constant may end on its bound: the fit then says the data want it beyond what is
    physical (docs/costmodel.md). From the default start this reaches the lowest minimum that random
    starts find (`tests/test_costmodel.py`); a few starts end in worse local minima."""
    try:
        from scipy.optimize import least_squares
    except ImportError:
        raise LadderError("fitting the cost model needs scipy: pip install scipy") from None
    names = list(init)
    lower = [bounds.get(name, (0.0, math.inf))[0] for name in names]
    upper = [bounds.get(name, (0.0, math.inf))[1] for name in names]
    errors = log_errors(rows, gpu, link_of)

    def residuals(x: torch.Tensor) -> torch.Tensor:
        k = dict(zip(names, x))
        return errors(k) if extra_residuals is None else torch.cat([errors(k), extra_residuals(k)])

    as_tensor = functools.partial(torch.tensor, dtype=torch.float64)
    result = least_squares(lambda x: residuals(as_tensor(x)).numpy(),
                           [float(init[name]) for name in names],
                           jac=lambda x: torch.autograd.functional.jacobian(residuals, as_tensor(x)).numpy(),
                           bounds=(lower, upper), method="trf", x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12)
    return {name: float(v) for name, v in zip(names, result.x)}


def fit_error(rows: list[dict[str, Any]], constants: Constants) -> float:
    """What `fit` minimises: the mean squared error of log tokens/s over `rows` (H100, link presets)."""
    k = {name: _t(v) for name, v in _values(constants).items()}
    return float((log_errors(rows)(k) ** 2).mean())


FITTED_FILE = "data/costmodel-fit.json"


def fit_on_paper() -> CostConstants:
    """Fit the constants on the training part of the paper's table (batch sizes 1 and 64). ~1 s."""
    return fit([r for r in paper_table() if r["batch_size"] in TRAIN_BATCHES])


def _stored_fit() -> dict[str, Any]:
    """costmodel-fit.json: the constants, their held-out validation and the unseen settings' reports."""
    return json.loads(resources.files("ladder").joinpath(FITTED_FILE).read_text())


def fitted_constants() -> CostConstants:
    """The stored result of `fit_on_paper()` (written by scripts/fit_costmodel.py, checked by a test)."""
    return CostConstants(**_stored_fit()["constants"])


def score(report: dict[str, Any]) -> str:
    """"7/10": a validation report's points within its tolerance, of all of them."""
    return f"{sum(p['within'] for p in report['points'])}/{len(report['points'])}"


def stored_accuracy(gpu: GPU = GPUS["h100"]) -> str:
    """Two lines on how close the stored fit comes to the paper's speedups (from its validation in
    costmodel-fit.json), printed under every prediction so no table is read as exact; a third for a
    GPU other than the H100 all of them were measured on."""
    stored = _stored_fit()
    held_out = stored["validation"]
    worst = max(abs(p["error"]) for p in held_out["points"])
    unseen = " and ".join(f"{score(report)} on {name}" for name, report in stored["unseen"].items())
    lines = (f"accuracy: speedups within {held_out['tolerance']} of the paper's on {score(held_out)} held-out "
             f"llama-3-70b points (worst off by {worst:.2f}),\n"
             f"          {unseen}, never fitted (ladder predict --validate)")
    if gpu != GPUS["h100"]:
        lines += (f"\n          all on H100s; on {gpu.name} the H100's fitted efficiencies and overheads are "
                  "assumed, not measured")
    return lines


def predict_table(preset: str, gpu: GPU, link: LinkModel, tp: int, batch_sizes: list[int],
                  layouts: list[str], prompt_len: int, gen_len: int,
                  constants: CostConstants | None = None, ladder_layers: Sequence[int] | None = None,
                  config: ModelConfig | None = None) -> list[dict[str, Any]]:
    """Predicted tokens/s for each (batch, layout): in all, per GPU, the speedup over standard and,
    for ladder, the share of standard's communication it hides (the paper's definition, as `ladder
    bench` reports it). `ladder_layers`: instead of whole ladder, a hybrid (ladder on the last N layers
    only) for each N. `config`: a shape that is no preset's (a checkpoint's), `preset` its label.
    `memory_bytes_per_gpu` is `ladder bench`'s estimate of one rank's peak, and
    `fits` whether that stays within the share of the GPU's memory `ladder bench` allows itself: the
    roofline knows no memory limit, so a row that does not fit predicts a run that cannot happen."""
    from ladder.bench import check_hybrids, estimate_memory_bytes, fits_in, layout_variants
    from ladder.results import hidden_fraction

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
        w = Workload(config, tp, b, prompt_len, gen_len)
        memory = estimate_memory_bytes(config, tp, b, prompt_len, prompt_len + gen_len, w.dtype_bytes)
        tps = {(name, n): predict_tokens_per_s(replace(w, ladder_layers=n), name, gpu, link, constants)
               for name, n in dict.fromkeys([*variants, ("standard", None), ("upper-bound", None)])}
        seconds = {variant: 1 / value for variant, value in tps.items()}  # per generated token: hidden's times
        standard, upper_bound = ("standard", None), ("upper-bound", None)
        for layout, n in variants:
            hidden = (hidden_fraction(seconds[standard], seconds[(layout, n)], seconds[upper_bound])
                      if layout == "ladder" else None)
            rows.append({"preset": preset, "gpu": gpu.name, "interconnect": link.name, "tp": tp, "batch_size": b,
                         "layout": layout, "ladder_layers": n, "tokens_per_s": tps[(layout, n)],
                         "tokens_per_s_per_gpu": tps[(layout, n)] / tp, "speedup": tps[(layout, n)] / tps[standard],
                         "hidden": hidden, "memory_bytes_per_gpu": memory, "fits": fits_in(memory, gpu.memory_bytes)})
    return rows


def validate(constants: Constants | None = None, tolerance: float = 0.05,
             link_of: LinkOf = _preset_link) -> dict[str, Any]:
    """Predicted vs published ladder/standard speedup at every held-out (TP, batch, P2P) point."""
    constants = constants or fitted_constants()
    by_key = paper_throughputs()
    points = []
    for (layout, tp, b, p2p), std in sorted(by_key.items()):
        if layout != "standard" or b not in HELD_OUT_BATCHES or ("ladder", tp, b, p2p) not in by_key:
            continue
        published = by_key[("ladder", tp, b, p2p)] / std
        w = Workload(get_preset("llama-3-70b"), tp, b)
        predicted = predicted_speedup(w, "ladder", GPUS["h100"], link_of(P2P_LINKS[p2p]), constants)
        points.append({"tp": tp, "batch_size": b, "p2p": p2p, "published": published, "predicted": predicted,
                       "error": predicted - published, "within": abs(predicted - published) <= tolerance})
    within = sum(p["within"] for p in points)
    return {"constants": _values(constants), "tolerance": tolerance, "points": points,
            "fraction_within": within / len(points) if points else 0.0,
            "train_batches": TRAIN_BATCHES, "held_out_batches": HELD_OUT_BATCHES}


@dataclass(frozen=True)
class UnseenSetting:
    """Published speedups over standard that no constant was fitted on, and the link presets that stand
    for the paper's two conditions there (chosen from what the hardware is, not from the errors)."""
    name: str
    csv: str  # in ladder/data: model, tp, batch, lengths, p2p, layout, speedup_over_standard
    links: dict[str, str]  # p2p condition -> link preset
    description: str


UNSEEN_SETTINGS = {setting.name: setting for setting in (
    UnseenSetting(
        "llama-3-8b", "data/llama3-8b-h100-tp8-speedups.csv", {"on": P2P_LINKS["on"]},
        "a shape never fitted: the paper's llama-3-8b speedups over standard, h100 x8, nvlink"),
    # Two nodes of 8: every all-reduce crosses InfiniBand (with P2P) or, with NCCL_P2P_DISABLE=1,
    # also goes through host memory inside each node, the condition pcie-no-p2p was fitted on.
    UnseenSetting(
        "llama-3.1-405b", "data/llama3.1-405b-h100-tp16-speedups.csv",
        {"on": "infiniband-ndr", "off": P2P_LINKS["off"]},
        "a shape and a link never fitted: the paper's llama-3.1-405b speedups, h100 x16 on two nodes,\n"
        "p2p on predicted with infiniband-ndr (a datasheet preset), off with pcie-no-p2p"),
)}


def unseen_rows(setting: UnseenSetting) -> list[tuple[Workload, str, str, float]]:
    """The setting's published points: (workload, layout, p2p condition, speedup over standard)."""
    text = resources.files("ladder").joinpath(setting.csv).read_text()
    return [(Workload(get_preset(r["model"]), int(r["tp"]), int(r["batch_size"]), int(r["prompt_len"]),
                      int(r["gen_len"])), r["layout"], r["p2p"], float(r["speedup_over_standard"]))
            for r in csv.DictReader(text.splitlines())]


def validate_unseen(setting: UnseenSetting, constants: Constants | None = None, tolerance: float = 0.05,
                    link_of: LinkOf = _preset_link) -> dict[str, Any]:
    """Predicted vs published speedup over standard where nothing was fitted: how the constants fitted
    on the 70B table at TP <= 8 carry over to another model size or another link."""
    constants = constants or fitted_constants()
    points = []
    for w, layout, p2p, published in unseen_rows(setting):
        link = link_of(setting.links[p2p])
        predicted = predicted_speedup(w, layout, GPUS["h100"], link, constants)
        points.append({"layout": layout, "tp": w.tp, "batch_size": w.batch_size, "p2p": p2p,
                       "interconnect": link.name, "published": published, "predicted": predicted,
                       "error": predicted - published, "within": abs(predicted - published) <= tolerance})
    within = sum(p["within"] for p in points)
    return {"setting": setting.name, "description": setting.description, "tolerance": tolerance, "points": points,
            "fraction_within": within / len(points)}
