"""`ladder bench`: the paper's throughput protocol over layouts x TP x batch, on real or emulated links.

Protocol (the paper's, gpt-fast style): random weights (or a real checkpoint's, `--model`), one
synthetic prompt repeated over the batch,
`gen_len` new tokens with top-k 200 / temperature 0.8, warm-up runs excluded, devices synchronised
before clocks are read, tokens/s = batch * gen_len / (prefill + decode).

Each configuration runs in its own worker processes (real interconnect: `tp` ranks; emulated: one
process holding rank 0's exact shard, since every rank does the same work) and its result is
appended to the JSON-lines file and flushed before the next one starts, so a sweep that dies keeps
everything measured so far. A configuration that fails (out of memory, a crash) is recorded as such.

`--interleave` measures the layouts of one configuration in one set of workers instead, taking turns
run by run, so that a shared machine's drift (+-10 % over minutes on a 2-core VM) hits every layout
alike; their results are appended together when the group ends. `--interleave steps` takes turns step
by step (every layout's prefill, then every layout's first decode step, ...): drift over seconds
then hits them alike too, and each layout's run time is the sum of its own steps.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ladder.config import ModelConfig, get_preset
from ladder.errors import LadderError, check_creatable
from ladder.interconnect import EmulatedCommunicator, LinkModel
from ladder.results import layout_label, read_bench_records

if TYPE_CHECKING:  # for annotations only: bench_on_rank imports the engine when a benchmark runs
    from ladder.engine import Engine, GenerationResult, SamplingParams

SCHEMA_VERSION = 1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class BenchPoint:
    """One configuration of a sweep."""

    preset: str
    layout: str
    tp: int
    batch_size: int
    prompt_len: int
    gen_len: int
    link: LinkModel | None = None  # None: the real interconnect (torch.distributed)
    link_scale: float = 1.0
    comm_share: float | None = None  # link_scale was calibrated for this share of standard's step
    ladder_layers: int | None = None
    warmup: int = 1
    runs: int = 3
    device: str = "auto"
    dtype: str | None = None
    compile: bool = False
    cuda_graph: bool = False  # the decode step captured as a CUDA graph (eager, or with compile_layers)
    compile_layers: bool = False  # each layer's branches compiled, one graph for all layers
    seed: int = 0
    top_k: int = 200
    temperature: float = 0.8
    checkpoint: str | None = None  # a GGUF file, HF folder or short name; None: random weights
    profile_dir: str | None = None  # write a profiler trace of one extra short run here
    profile_tokens: int = 8  # new tokens of that run (the trace of a whole 512-token run is huge)

    @property
    def emulated(self) -> bool:
        return self.link is not None

    def with_dtype_resolved(self) -> BenchPoint:
        """The point with the dtype it will run in (the default depends on the device), as its results
        record it: `--resume` compares points with records."""
        from ladder.distributed import pick_device

        return dataclasses.replace(self, dtype=dtype_name(self, pick_device(self.device)))

    @property
    def interconnect(self) -> str:
        return self.link.name if self.link else "real"

    def config(self) -> ModelConfig:
        if self.checkpoint is not None:
            from ladder.checkpoint import with_layout

            config = with_layout(checkpoint_config(self.checkpoint), self.layout, self.ladder_layers)
        else:
            changes: dict[str, Any] = {"layout": self.layout}
            if self.ladder_layers is not None:
                changes["ladder_layers"] = self.ladder_layers
            config = get_preset(self.preset, **changes)
        config.check_tp(self.tp)
        return config

    def describe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["link"] = self.link.to_dict() if self.link else None
        d["interconnect"] = self.interconnect
        d["emulated"] = self.emulated
        return d


@functools.cache
def checkpoint_config(name_or_path: str) -> ModelConfig:
    """A checkpoint's config (its header only; read once per process)."""
    from ladder.checkpoint import open_checkpoint

    return open_checkpoint(name_or_path).config


# ---- memory estimate (to refuse what cannot fit, before launching) -------------------------------

def estimate_memory_bytes(config: ModelConfig, tp: int, batch: int, prompt_len: int, seq: int, dtype_bytes: int,
                          models: int = 1, weight_sets: int = 1) -> int:
    """One rank's weights (shared by the `models` models: one set, unless `weight_sets` says otherwise),
    the KV cache of each model, and the largest activation (one model runs at a time: the prefill's),
    in bytes. Within 2 % of the peak an H100 measured for the 70B shard at TP 8, batch 64
    (tests/test_bench.py)."""
    kv_heads = max(1, config.n_kv_heads // tp)
    vocab_weights = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)  # whole on every rank
    weights = (config.n_params() - vocab_weights) / tp + vocab_weights
    kv_cache = 2 * config.n_layers * batch * kv_heads * seq * config.head_dim
    # The prefill of one layer: its inputs, norms and outputs (dim wide), the MLP's gate, up and product
    # (ffn / tp wide), and the attention scores in case SDPA takes its math path; then the logits of the
    # last position only (in float32).
    tokens = batch * prompt_len
    activations = (tokens * (4 * config.dim + 3 * config.ffn_hidden // tp)
                   + batch * max(1, config.n_heads // tp) * prompt_len * seq
                   + batch * config.vocab_size * 4 // dtype_bytes)
    return int((weight_sets * weights + models * kv_cache + activations) * dtype_bytes)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def dtype_name(point: BenchPoint, device: torch.device) -> str:
    """--dtype, else bfloat16 on GPU (as the paper's fp16 runs: 2 bytes) and float32 on CPU."""
    return point.dtype or ("bfloat16" if device.type == "cuda" else "float32")


MEMORY_USABLE = 0.9  # of a device's memory; the rest is the allocator's, CUDA's and the graphs' own


def fits_in(need_bytes: int, device_bytes: int) -> bool:
    """Whether a rank needing `need_bytes` (`estimate_memory_bytes`) fits a device of `device_bytes`."""
    return need_bytes <= MEMORY_USABLE * device_bytes


def check_fits(group: Sequence[BenchPoint], device: torch.device) -> None:
    """Refuse a group of configurations (one, or the layouts measured together by --interleave) whose
    models cannot fit on `device`."""
    point = group[0]
    config = point.config()
    dtype = dtype_name(point, device)
    procs_per_host = point.tp if not point.emulated and device.type == "cpu" else 1
    need = estimate_memory_bytes(config, point.tp, point.batch_size, point.prompt_len,
                                 point.prompt_len + point.gen_len, DTYPE_BYTES[dtype], len(group)) * procs_per_host
    have = available_memory_bytes(device)
    if not fits_in(need, have):
        what = point.preset if len(group) == 1 else f"{point.preset} ({len(group)} layouts together)"
        hint = "" if len(group) == 1 else "; measure fewer layouts together, or without --interleave"
        raise LadderError(f"{what} at tp={point.tp}, batch {point.batch_size}, "
                          f"{point.prompt_len}+{point.gen_len} tokens needs about {need / 2**30:.1f} GiB, more "
                          f"than {MEMORY_USABLE:.0%} of this {device.type}'s {have / 2**30:.1f} GiB{hint}")


# ---- one configuration (or a group measured together), on each rank --------------------------------

INTERLEAVE_MODES = ("runs", "steps")


def bench_on_rank(group: Sequence[BenchPoint], interleave: str = "runs") -> list[dict[str, Any]] | None:
    """Measure configurations that differ only in layout, in one set of workers; returns their
    results on rank 0, None on the others. With several, the measured runs take turns (standard,
    ladder, upper-bound, ladder, upper-bound, standard, ...) so that the machine's drift hits every
    layout alike, or with `interleave="steps"` their steps do (`generate_in_turns`); warm-up runs of
    every layout come first."""
    from ladder.distributed import shutdown_distributed
    from ladder.launch import under_torchrun
    from ladder.engine import Engine, SamplingParams

    first = group[0]
    device, rank, comms, hosts = _communicators(group)
    try:
        check_fits(group, device)
        dtype = dtype_name(first, device)
        configs = [p.config() for p in group]
        models = _build_models(first, configs, comms, device, getattr(torch, dtype))
        engines = [Engine(model, compile=first.compile, cuda_graph=first.cuda_graph,
                          compile_layers=first.compile_layers) for model in models]
        gen = torch.Generator().manual_seed(first.seed)
        prompt = torch.randint(0, configs[0].vocab_size, (1, first.prompt_len), generator=gen)
        prompt = prompt.repeat(first.batch_size, 1)  # one synthetic prompt repeated over the batch
        sampling = SamplingParams(temperature=first.temperature, top_k=first.top_k, seed=first.seed)
        runs, turns = _measure(group, engines, comms, prompt, sampling, device, interleave)
        traces = [_profile(p, e, prompt, sampling, c, rank) if p.profile_dir else None
                  for p, e, c in zip(group, engines, comms)]
        if rank != 0:
            return None
        results = [_result(point, configs[j], models[j], device, dtype, runs[j], comms[j])
                   for j, point in enumerate(group)]
        _annotate_group(results, group, interleave, turns, traces, hosts)
        return results
    finally:
        # Under torchrun the group lives for the whole sweep (`run_sweep` ends it): made anew for each
        # configuration, the second one's set-up hung about one time in two on the first one's leftovers.
        if not first.emulated and not under_torchrun():
            shutdown_distributed()


def _communicators(group: Sequence[BenchPoint]) -> tuple[torch.device, int, list[Any], list[str] | None]:
    """(device, rank, one communicator per point, the host of each rank or None when emulated).

    An emulated link needs no process group: this process computes rank 0's shard and waits out the
    modelled all-reduces. A real one joins (or, under torchrun, reuses) the group of TP ranks."""
    from ladder.distributed import init_distributed, pick_device

    first = group[0]
    if first.emulated:
        device = pick_device(first.device)
        return device, 0, [EmulatedCommunicator(p.link, p.tp, device, p.link_scale) for p in group], None
    ctx = init_distributed(first.device)
    return ctx.device, ctx.rank, [ctx.communicator()] * len(group), host_of_each_rank_measuring(group)


def _measure(group: Sequence[BenchPoint], engines: Sequence[Engine], comms: Sequence[Any], prompt: torch.Tensor,
             sampling: SamplingParams, device: torch.device, interleave: str
             ) -> tuple[list[list[Any]], list[list[int]]]:
    """Warm every engine up, then run the measured runs; returns each point's runs and, when runs take
    turns, the turn at which each of its runs happened (in the group's order)."""
    from ladder.engine import synchronize

    first = group[0]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for engine in engines:
        for _ in range(first.warmup):
            engine.generate(prompt, first.gen_len, sampling)
    for comm in comms:
        if isinstance(comm, EmulatedCommunicator):
            comm.reset_counters()  # count the measured runs only
    runs: list[list[Any]] = [[] for _ in group]
    turns: list[list[int]] = [[] for _ in group]
    for i in range(first.runs):
        if interleave == "steps" and len(group) > 1:
            for j, run in enumerate(generate_in_turns(engines, prompt, first.gen_len, sampling, shift=i)):
                runs[j].append(run)
        else:
            for turn, j in enumerate(turn_order(len(group), i), start=i * len(group)):
                synchronize(device)
                turns[j].append(turn)
                runs[j].append(engines[j].generate(prompt, first.gen_len, sampling))
    return runs, turns


def _annotate_group(results: list[dict[str, Any]], group: Sequence[BenchPoint], interleave: str,
                    turns: list[list[int]], traces: list[Any], hosts: list[str] | None) -> None:
    """Add to each record what it shares with its group: the interleaving, its trace, the ranks' hosts."""
    # What keeps this group's records together when results are pooled (each record's env.time can
    # fall in the next second): where it ran and when it finished measuring.
    group_id = f"{socket.gethostname()}:{os.getpid()}:{time.time():.6f}"
    for j, result in enumerate(results):
        if len(group) > 1:
            result["interleaved"] = {"layouts": [layout_label(p.describe()) for p in group], "by": interleave,
                                     "group": group_id}
            if interleave == "runs":
                result["interleaved"]["turns"] = turns[j]
            result["peak_memory_kind"] += " (all layouts of the group)"
        if traces[j] is not None:
            result["trace"] = traces[j]
        if hosts is not None:  # which machines the ranks ran on: the link between them was measured
            result["env"] |= {"rank_hosts": hosts, "nodes": len(set(hosts))}


class RanksDisagree(LadderError):
    """Ranks started by torchrun were about to measure different configurations: the sweep stops."""


def host_of_each_rank_measuring(group: Sequence[BenchPoint]) -> list[str]:
    """The machine of every rank, once they agree on what they are about to measure: ranks given
    different options (under torchrun each node has its own command line) would time the collectives
    of different configurations paired."""
    import torch.distributed as dist

    from ladder.distributed import from_every_rank

    mine = [p.describe() for p in group]
    everyone = from_every_rank((mine, socket.gethostname()))
    for rank, (theirs, _) in enumerate(everyone):
        if theirs != mine:
            differ = sorted({k for a, b in zip(theirs, mine) for k in a if a[k] != b.get(k)}) or ["layouts"]
            raise RanksDisagree(f"rank {rank} and rank {dist.get_rank()} are about to measure different "
                                f"configurations (they differ in {', '.join(differ)}): start every node with "
                                "the same command")
    return [host for _, host in everyone]


def agree_on_measured_already(done: dict[str, dict[str, Any]], points: Sequence[BenchPoint]
                              ) -> dict[str, dict[str, Any]]:
    """Under torchrun, rank 0's `--resume` records for every rank: the others read the file on their own
    machines (absent, or another run's), so they would skip other configurations than rank 0 does."""
    import torch.distributed as dist

    from ladder.distributed import init_distributed

    init_distributed(points[0].device)
    box = [done]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def generate_in_turns(engines: Sequence[Engine], prompt: torch.Tensor, gen_len: int, sampling: SamplingParams,
                      shift: int = 0) -> list[GenerationResult]:
    """One generation per engine (one per layout, each with its own KV cache), stepped in turns: every
    prefill, then every first decode step, and so on, each turn in its own order (`turn_order`). Each
    result times only its own steps."""
    generations = [engine.start(prompt, gen_len, sampling) for engine in engines]
    for turn in itertools.count(shift * (gen_len + 1)):
        if all(g.finished for g in generations):
            break
        for j in turn_order(len(generations), turn):
            if not generations[j].finished:
                generations[j].step()
    return [g.result() for g in generations]


def turn_order(n: int, turn: int) -> list[int]:
    """The order in which n layouts take turn `turn`: a permutation drawn for that turn (reproducible).
    What a layout follows matters on a CPU (the caches it finds, whether the intra-op threads it needs
    went to sleep while the last one waited), and rotating one order would not vary it: in
    [s p l u], [p l u s], ... ladder follows parallel at 3 turns out of 4 and standard follows upper
    bound at all but the first. Drawn anew each turn, every layout follows every other equally often
    on average."""
    order = list(range(n))
    random.Random(turn).shuffle(order)
    return order


def _build_models(point: BenchPoint, configs: list[ModelConfig], comms: list[Any], device: torch.device,
                  dtype: torch.dtype) -> list[torch.nn.Module]:
    """One model per layout, every one computing with one set of weights (`share_weights`), held by a
    layout with every parameter (parallel, with one norm per layer, has fewer) whatever the order of
    the layouts: measured in turns, layouts on different weights would start with caches that
    differ."""
    from ladder.weights import build_model, init_local_shard, share_weights

    models: dict[int, torch.nn.Module] = {}
    owners: list[torch.nn.Module] = []  # the models that hold a set of weights
    for i in sorted(range(len(configs)), key=lambda i: configs[i].layout == "parallel"):
        config, comm = configs[i], comms[i]
        shared = (share_weights(config, comm, owner) for owner in owners)
        model = next((m for m in shared if m is not None), None)
        if model is None:
            model = build_model(config, comm, device, dtype)
            owners.append(model)
            if point.checkpoint is None:
                init_local_shard(model, point.seed)
            else:
                from ladder.checkpoint import open_checkpoint
                from ladder.weights import load_weights

                load_weights(model, open_checkpoint(point.checkpoint).source)
        models[i] = model
    return [models[i] for i in range(len(configs))]


# ---- --comm-share: a link dilated to a share of the step --------------------------------------------

_NO_DURATION = 1e-9  # a link scale whose waits are nothing, and whose modelled time / it is the undilated time


def calibrate_link_scale(point: BenchPoint, share: float, steps: int = 16) -> tuple[float, float, float]:
    """`--comm-share`: the link scale at which the emulated all-reduces take `share` of standard's decode
    step on this machine, and the two times it comes from (compute and undilated link, s a step).

    A fixed `--link-scale` keeps the link, so the compute : communication ratio moves with this machine's
    speed on the day (30 % from one day to the next on a shared 2-core VM); this keeps the ratio where
    the modelled GPUs have it. Rank 0's standard shard is timed over a link of no duration, in a worker
    like the measured ones (same threads)."""
    from ladder.launch import launch

    compute_s, link_s = launch(_standard_step_times, 1, point, steps, isolate=True, device=point.device)[0]
    if link_s <= 0:
        raise LadderError(f"--comm-share: {point.preset} at tp={point.tp} sends nothing to dilate")
    return share / (1 - share) * compute_s / link_s, compute_s, link_s


def dilate_to_share(points: Sequence[BenchPoint], share: float, done: dict[str, dict[str, Any]],
                    report: Callable[[str], None]) -> list[BenchPoint]:
    """The emulated points with the link scale that gives `share` (`calibrate_link_scale`), one
    calibration per configuration; with `--resume`, the scale a configuration was measured at before."""
    check_comm_share(points, share)
    earlier = {_without_scale(r): r["link_scale"] for r in done.values() if r.get("comm_share") == share}
    scales: dict[str, float] = {}
    out = []
    for point in points:
        if not point.emulated:
            out.append(point)
            continue
        key = _without_scale(point.with_dtype_resolved().describe())
        if key not in scales:
            where = f"  --comm-share {share:g}: {point.interconnect} tp={point.tp} bs={point.batch_size}"
            if key in earlier:
                scales[key] = earlier[key]
                report(f"{where}: x{scales[key]:.3g}, as measured before (--resume)")
            else:
                scales[key], compute_s, link_s = calibrate_link_scale(point, share)
                report(f"{where}: x{scales[key]:.3g} (standard's step here: {compute_s * 1e3:.2f} ms of compute, "
                       f"{link_s * 1e3:.3f} ms on the undilated link)")
        out.append(dataclasses.replace(point, link_scale=scales[key], comm_share=share))
    return out


def check_comm_share(points: Sequence[BenchPoint], share: float) -> None:
    """Refuse a `--comm-share` that cannot be calibrated, before anything runs."""
    from ladder.distributed import pick_device
    from ladder.launch import under_torchrun

    if not 0 < share < 1:
        raise LadderError(f"--comm-share is a share of the step, between 0 and 1, not {share:g}")
    if any(p.link_scale != 1 for p in points):
        raise LadderError("--comm-share and --link-scale both set how far the link is dilated: give one")
    if not any(p.emulated for p in points):
        raise LadderError("--comm-share dilates an emulated link, and --interconnect real has none: "
                          "name one, e.g. --interconnect pcie-no-p2p")
    if under_torchrun():
        raise LadderError("--comm-share calibrates on one process: under torchrun give every rank the same "
                          "--link-scale")
    if any(pick_device(p.device).type != "cpu" for p in points if p.emulated):
        raise LadderError("--comm-share calibrates CPU steps; on a GPU use the link's own times "
                          "(--link-scale 1) or a --link-scale of your choice")


def _without_scale(description: dict[str, Any]) -> str:
    """A point's settings but its layout and link scale: what one calibration serves."""
    return json.dumps(_settings(description, frozenset({"layout", "ladder_layers", "link_scale", "comm_share"})),
                      sort_keys=True)


def _standard_step_times(point: BenchPoint, steps: int) -> tuple[float, float]:
    """Median compute time of standard's decode step (eager or compiled, as the point will run it), and
    its all-reduces' undilated link time."""
    from ladder.distributed import pick_device
    from ladder.engine import Engine

    device = pick_device(point.device)
    comm = EmulatedCommunicator(point.link, point.tp, device, _NO_DURATION)
    point = dataclasses.replace(point, layout="standard", ladder_layers=None)
    [model] = _build_models(point, [point.config()], [comm], device, getattr(torch, dtype_name(point, device)))
    engine = Engine(model, compile=point.compile, compile_layers=point.compile_layers)
    model.setup_caches(point.batch_size, point.prompt_len + point.gen_len)
    token = torch.zeros(point.batch_size, 1, dtype=torch.long, device=device)
    times = []
    with torch.inference_mode():
        for i in range(steps + 3):  # 3 warm-up steps (compiling, if the point compiles)
            if i == 3:
                comm.reset_counters()
            start = time.perf_counter()
            engine.decode(token, torch.tensor([point.prompt_len + i % point.gen_len], device=device))
            times.append(time.perf_counter() - start)
    return statistics.median(times[3:]), comm.modelled_s / _NO_DURATION / steps


def trace_name(point: BenchPoint, rank: int) -> str:
    layout = point.layout if point.ladder_layers is None else f"{point.layout}{point.ladder_layers}"
    link = point.interconnect + (f"-x{point.link_scale:g}" if point.emulated and point.link_scale != 1 else "")
    return f"{point.preset}-{layout}-tp{point.tp}-bs{point.batch_size}-{link}-rank{rank}.json"


def _profile(point: BenchPoint, engine: Any, prompt: torch.Tensor, sampling: Any, comm: object,
             rank: int) -> dict[str, Any]:
    """One extra short generation under the profiler (not part of the measured runs): its trace, and
    the share of communication time during which compute ran, read back from the trace."""
    from ladder.trace import link_overlap, profile_generation

    path = Path(point.profile_dir) / trace_name(point, rank)
    max_seq = point.prompt_len + max(point.gen_len, point.profile_tokens)  # the measured runs' if it fits
    events = profile_generation(engine, prompt, point.profile_tokens, sampling, comm, path, max_seq)
    return {"path": str(path), "new_tokens": point.profile_tokens, "link": link_overlap(events)}


def _result(point: BenchPoint, config: ModelConfig, model: torch.nn.Module, device: torch.device,
            dtype: str, runs: list, comm: object) -> dict[str, Any]:
    prefill = [r.prefill_s for r in runs]
    decode = [r.decode_s for r in runs]
    latencies = sorted(t for r in runs for t in r.token_latencies_s)
    tokens_per_s = [point.batch_size * point.gen_len / (p + d) for p, d in zip(prefill, decode)]
    step_s = statistics.median(latencies) if latencies else float("nan")
    # Bytes one decode step must read: this rank's weights plus the KV cache at mid-generation.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_heads = model.shard.n_kv_heads
    mid_len = point.prompt_len + point.gen_len // 2
    kv_bytes = 2 * config.n_layers * point.batch_size * kv_heads * mid_len * config.head_dim * DTYPE_BYTES[dtype]
    if device.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    else:
        peak, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_max_rss"
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "status": "ok",
        **point.describe(),
        "layout_name": config.layout_name,
        "weights": "random" if point.checkpoint is None else "checkpoint",
        "model": {k: getattr(config, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                                                  "vocab_size")} | {"n_params": config.n_params()},
        "dtype": dtype,
        # Medians over the measured runs: robust to a run disturbed by the machine (2-core CPUs are noisy).
        "prefill_s": statistics.median(prefill),
        "decode_s": statistics.median(decode),
        "total_s": statistics.median(p + d for p, d in zip(prefill, decode)),
        "tokens_per_s": statistics.median(tokens_per_s),
        "tokens_per_s_runs": tokens_per_s,
        "tokens_per_s_per_device": statistics.median(tokens_per_s) / point.tp,
        "decode_token_latency_ms": _percentiles([t * 1e3 for t in latencies]),
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "weight_bytes_per_rank": weight_bytes,
        "achieved_bandwidth_gbps": (weight_bytes + kv_bytes) / step_s / 1e9,
        "env": environment(device),
    }
    # With CUDA graphs the emulated link's ops run on the host only when a graph is captured, not at
    # each replay: the host cannot count them.
    if isinstance(comm, EmulatedCommunicator) and not ((point.compile or point.cuda_graph) and device.type == "cuda"):
        result["modelled_comm_s_per_run"] = comm.modelled_s / max(point.runs, 1)
        result["all_reduces_per_run"] = comm.count // max(point.runs, 1)
        result["exposed_comm_s_per_run"] = comm.exposed_s / max(point.runs, 1)
        result["hidden_in_run"] = comm.hidden_fraction
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"mean": statistics.mean(values), "p50": q[49], "p90": q[89], "p99": q[98], "n": len(values)}


def environment(device: torch.device) -> dict[str, Any]:
    from ladder import __version__
    env: dict[str, Any] = {
        "ladder": __version__,
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def git_commit(package_dir: Path = Path(__file__).parent) -> str | None:
    """The checkout's commit, with "-dirty" when the package's own files differ from it (the code that ran
    is not that commit's). Only the package counts: the benchmark rewrites tracked results files itself
    (scripts/run.sh's results/cpu/bench.jsonl), and those do not change what ran."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=package_dir).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return (commit + "-dirty" if git("status", "--porcelain", "--", ".") else commit) or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- the sweep ------------------------------------------------------------------------------------

def sweep_points(presets: Sequence[str], layouts: Sequence[str], tps: Sequence[int], batch_sizes: Sequence[int],
                 links: Sequence[LinkModel | None], **common: Any) -> list[BenchPoint]:
    """Every combination, validated up front (unknown names and impossible TP degrees fail at once).
    `ladder_layers` (a list of N): the ladder layout becomes one hybrid per N, ladder on the last N layers."""
    ladder_layers = common.pop("ladder_layers", None)
    check_hybrids(ladder_layers, layouts)
    # Hybrid is a kind of ladder: the other layouts stay whole, the baselines it is compared with.
    points = [BenchPoint(preset=p, layout=layout, tp=tp, batch_size=b, link=link, ladder_layers=n, **common)
              for p in presets for link in links for tp in tps for b in batch_sizes
              for layout, n in layout_variants(layouts, ladder_layers)]
    from ladder.distributed import pick_device
    from ladder.launch import check_launchable, under_torchrun

    if under_torchrun():  # the ranks are torchrun's: a real link runs at exactly that many
        world = int(os.environ["WORLD_SIZE"])
        other = sorted({p.tp for p in points if not p.emulated and p.tp != world})
        if other:
            raise LadderError(f"under torchrun (WORLD_SIZE={world}) the real interconnect runs at --tp {world} only, "
                              f"not {', '.join(map(str, other))}; an emulated link (--interconnect NAME) runs any "
                              "--tp on each rank")
    # an unknown device, or CUDA on a machine without it, fails here
    device_types = {device: pick_device(device).type for device in {p.device for p in points}}
    if any(p.link_scale != 1 for p in points) and not any(p.emulated for p in points):
        raise LadderError("--link-scale dilates an emulated link, and --interconnect real has none: "
                          "name one, e.g. --interconnect pcie-no-p2p")
    for point in points:
        config = point.config()
        if not point.emulated:
            check_launchable(point.tp, device=point.device)
        if point.runs < 1 or point.warmup < 0:
            raise LadderError(f"--runs must be >= 1 and --warmup >= 0, got {point.runs} and {point.warmup}")
        if not (math.isfinite(point.link_scale) and point.link_scale > 0):
            raise LadderError(f"--link-scale must be a positive number, got {point.link_scale:g}")
        if point.cuda_graph and point.compile:
            raise LadderError("--cuda-graph and --compile both make the decode step a CUDA graph: give one")
        if point.compile_layers and point.compile:
            raise LadderError("--compile compiles the whole decode step and --compile-layers each layer: give one "
                              "(--compile-layers --cuda-graph: compiled layers in one CUDA graph)")
        if point.cuda_graph and device_types[point.device] != "cuda":
            raise LadderError(f"--cuda-graph needs a CUDA device, and --device {point.device} is "
                              f"{device_types[point.device]}")
        if point.profile_dir is not None and point.profile_tokens < 1:
            raise LadderError(f"--profile-tokens must be >= 1, got {point.profile_tokens}")
        if point.batch_size < 1 or point.prompt_len < 1 or point.gen_len < 1:
            raise LadderError("batch sizes, --prompt-len and --gen-len must be >= 1")
        if point.prompt_len + point.gen_len > config.max_seq_len:
            raise LadderError(f"--prompt-len {point.prompt_len} + --gen-len {point.gen_len} exceeds "
                              f"{point.preset}'s max_seq_len {config.max_seq_len}")
    return points


def layout_variants(layouts: Sequence[str], ladder_layers: Sequence[int] | None) -> list[tuple[str, int | None]]:
    """(layout, N) to measure: ladder once per N of `ladder_layers` (hybrid; once, whole, without them),
    every other layout once, whole (N None)."""
    return [(layout, n) for layout in layouts for n in (ladder_layers if layout == "ladder" and ladder_layers
                                                        else [None])]


def check_hybrids(ladder_layers: Sequence[int] | None, layouts: Sequence[str]) -> None:
    """`--ladder-layers` turns the ladder layout into hybrids: refuse it where there is no ladder to turn."""
    if ladder_layers is not None and "ladder" not in layouts:
        raise LadderError(f"--ladder-layers {','.join(map(str, ladder_layers))} makes the ladder layout hybrid, "
                          f"and --layouts {','.join(layouts)} has no ladder")


def run_group(group: Sequence[BenchPoint], interleave: str = "runs") -> list[dict[str, Any]]:
    """Measure one configuration, or several measured together, in fresh worker processes; a failure
    becomes a `failed` record for each of them."""
    from ladder.launch import launch, under_torchrun

    first = group[0]
    nproc = 1 if first.emulated else first.tp
    try:
        if under_torchrun() and first.emulated:
            results = bench_on_rank(group, interleave)  # every rank measures its own copy; rank 0 reports
        else:
            results = launch(bench_on_rank, nproc, group, interleave, isolate=True, device=first.device).get(0)
    except RanksDisagree:
        raise  # every configuration after this one would be mismatched too
    except LadderError as exc:
        return [{"schema": SCHEMA_VERSION, "status": "failed", "error": str(exc), **p.describe()} for p in group]
    return results or []  # nothing on a non-zero rank under torchrun


def interleaved_groups(points: Sequence[BenchPoint]) -> list[list[BenchPoint]]:
    """Points that differ only in layout, grouped (in sweep order) to be measured together."""
    groups: dict[BenchPoint, list[BenchPoint]] = {}
    for p in points:
        groups.setdefault(dataclasses.replace(p, layout="", ladder_layers=None), []).append(p)
    return list(groups.values())


def _drop_cut_line(path: Path) -> None:
    """Every record is written whole with its newline: text after the last newline is a record a killed
    run was cut off writing, not a result. Remove it so that the next record starts a line."""
    if not path.is_file():
        return
    with path.open("r+b") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        f.truncate(f.read().rfind(b"\n") + 1)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record and make sure it is on disk before the next configuration starts."""
    _drop_cut_line(path)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def check_results_file(out: Path) -> None:
    """Refuse a results path that cannot be appended to before measuring, not after the first
    configuration's minutes."""
    if out.is_dir():
        raise LadderError(f"--out {out} is a folder; name a file in it, e.g. {out / 'bench.jsonl'}")
    check_creatable(out)
    existed = out.exists()
    try:  # opening is the only true test: permission bits say nothing to root, or on /proc
        with out.open("a"):
            pass
    except OSError as exc:
        raise LadderError(f"cannot write results to {out}: {exc.strerror.lower()}") from None
    if not existed:  # the file is made by the first result, so a sweep that measures nothing leaves none
        out.unlink()
    elif out.is_file():  # appending results to another tool's file would spoil both
        try:
            read_bench_records(out)
        except LadderError as exc:
            raise LadderError(f"--out names a file that is not ladder bench results: {exc}; name another file") from None


def check_trace_folder(folder: Path) -> None:
    """Make `--profile`'s folder before measuring, or say in one line why it cannot be one."""
    if folder.exists() and not folder.is_dir():
        raise LadderError(f"--profile {folder} is a file; name a folder for the traces")
    check_creatable(folder / "trace.json.gz")


def point_key(description: dict[str, Any], round_: int) -> str:
    """What identifies a measurement: the point's every setting (as `describe()` gives it) and its round."""
    return json.dumps([_settings(description), round_], sort_keys=True)


def _settings(description: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A point's settings as `describe()` (or a record of it) gives them, but those in `skip`. A setting
    added after a record was written takes its default there."""
    return {f.name: description.get(f.name, None if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(BenchPoint) if f.name not in skip}


def measured_already(out: Path) -> dict[str, dict[str, Any]]:
    """The successful records of a results file, by `point_key` (a later record of a key wins)."""
    if not out.is_file():
        return {}
    return {point_key(r, r.get("round", 0)): r for r in read_bench_records(out) if r["status"] == "ok"}


def check_repetition(rounds: int, interleave: str | None) -> None:
    """Refuse `--rounds` and `--interleave` values a sweep cannot run, before it is announced."""
    if rounds < 1:
        raise LadderError(f"--rounds must be at least 1, got {rounds}")
    if interleave not in (None, *INTERLEAVE_MODES):
        raise LadderError(f"--interleave takes {' or '.join(INTERLEAVE_MODES)}, not {interleave!r}")


def run_sweep(points: list[BenchPoint], out: Path, progress: bool = True, rounds: int = 1,
              interleave: str | None = None, done: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Measure every point, `rounds` times over: round-robin, so that a slow spell of a shared machine
    hits every layout alike instead of biasing whichever configuration ran during it. `interleave`:
    "runs" or "steps": the layouts of a configuration share one set of workers and take turns run by
    run or step by step (finer still).
    `done` (`measured_already(out)`, to resume): points (and rounds) with a record there are not
    measured again; their records are returned with the new ones (an interrupted sweep, or one cut
    into time-limited jobs)."""
    from tqdm import tqdm

    from ladder.distributed import is_rank0, shutdown_distributed
    from ladder.launch import under_torchrun

    check_repetition(rounds, interleave)
    is_main = is_rank0()
    if is_main:
        check_results_file(out)
    points = [p.with_dtype_resolved() for p in points]
    done = done or {}
    records = []
    groups = interleaved_groups(points) if interleave else [[p] for p in points]
    bar = tqdm(total=rounds * len(points), desc="bench", unit="config", disable=not (progress and is_main),
               dynamic_ncols=True)
    try:
        if under_torchrun() and any(not p.emulated for p in points):
            done = agree_on_measured_already(done, points)
        for i in range(rounds):
            for group in groups:
                keys = [point_key(p.describe(), i) for p in group]
                if all(k in done for k in keys):
                    records.extend(done[k] for k in keys)
                    bar.update(len(group))
                    continue
                first = group[0]
                layouts = "+".join(layout_label(p.describe()) for p in group)
                bar.set_postfix_str(f"{first.preset} {layouts} tp={first.tp} bs={first.batch_size} "
                                    f"{first.interconnect}" + (f" round {i + 1}/{rounds}" if rounds > 1 else ""))
                for record in run_group(group, interleave or "runs"):
                    if not is_main:
                        continue
                    record["round"] = i
                    earlier = done.get(point_key(record, i))
                    if earlier is not None:  # a group measured again for a layout of it that failed
                        records.append(earlier)
                        continue
                    append_jsonl(out, record)
                    records.append(record)
                    if record["status"] != "ok":
                        bar.write(f"failed: {layout_label(record)} tp={record['tp']} bs={record['batch_size']}: "
                                  f"{record['error']}")
                bar.update(len(group))
    finally:
        bar.close()
        if under_torchrun():
            shutdown_distributed()  # the one group of the sweep (see bench_on_rank)
    return records
