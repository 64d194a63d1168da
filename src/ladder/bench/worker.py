"""One configuration, or the layouts of one measured together, on each rank: build the models, warm
up, run the measured runs (in turns when several layouts share the workers), and make each result
record. `ladder.bench.sweep` launches this in fresh worker processes for every configuration."""

from __future__ import annotations

import itertools
import os
import random
import resource
import socket
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ladder.bench.records import SCHEMA_VERSION, environment
from ladder.bench.spec import BenchPoint
from ladder.bench.summary import layout_label, percentiles
from ladder.bench.trace import link_overlap, profile_generation
from ladder.comm.distributed import from_every_rank, init_distributed, pick_device, shutdown_distributed
from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.launch import under_torchrun
from ladder.cpu.linears import weight_bytes
from ladder.errors import LadderError
from ladder.model.config import DTYPE_BYTES
from ladder.model.transformer import Transformer
from ladder.model.weights import share_weights
from ladder.runtime.engine import Engine, GenerationResult
from ladder.runtime.memory import MEMORY_USABLE, available_memory_bytes, estimate_memory_bytes, fits_in, kv_cache_bytes
from ladder.runtime.sampling import SamplingParams
from ladder.runtime.step_clock import StepClock, synchronize


def check_fits(group: Sequence[BenchPoint], device: torch.device) -> None:
    """Refuse a group of configurations (one, or the layouts measured together by --interleave) whose
    models cannot fit on `device`."""
    point = group[0]
    config = point.config()
    dtype = point.model_spec().dtype_name(device)
    procs_per_host = point.tp if not point.emulated and device.type == "cpu" else 1
    need = estimate_memory_bytes(config, point.tp, point.batch_size, point.prompt_len,
                                 point.prompt_len + point.gen_len, DTYPE_BYTES[dtype], len(group),
                                 quantize=point.quantize,
                                 cpu_step=point.decode_step if device.type == "cpu" else None) * procs_per_host
    have = available_memory_bytes(device)
    if not fits_in(need, have):
        what = point.preset if len(group) == 1 else f"{point.preset} ({len(group)} layouts together)"
        hint = "" if len(group) == 1 else "; measure fewer layouts together, or without --interleave"
        raise LadderError(f"{what} at tp={point.tp}, batch {point.batch_size}, "
                          f"{point.prompt_len}+{point.gen_len} tokens needs about {need / 2**30:.1f} GiB, more "
                          f"than {MEMORY_USABLE:.0%} of this {device.type}'s {have / 2**30:.1f} GiB{hint}")


def bench_on_rank(group: Sequence[BenchPoint], interleave: str = "runs") -> list[dict[str, Any]] | None:
    """Measure configurations that differ only in layout, in one set of workers; returns their
    results on rank 0, None on the others. With several, the measured runs take turns (standard,
    ladder, upper-bound, ladder, upper-bound, standard, ...) so that the machine's drift hits every
    layout alike, or with `interleave="steps"` their steps do (`generate_in_turns`); warm-up runs of
    every layout come first."""
    first = group[0]
    device, rank, comms, hosts = _communicators(group)
    try:
        check_fits(group, device)
        dtype = first.model_spec().dtype_name(device)
        engines = [Engine(model, first.decode_step) for model in build_models(group, comms, device)]
        models = [engine.model for engine in engines]  # the engines' views: the weights they packed replace the models'
        gen = torch.Generator().manual_seed(first.seed)
        prompt = torch.randint(0, models[0].config.vocab_size, (1, first.prompt_len), generator=gen)
        prompt = prompt.repeat(first.batch_size, 1)  # one synthetic prompt repeated over the batch
        sampling = SamplingParams(temperature=first.temperature, top_k=first.top_k, seed=first.seed)
        runs, turns = _measure(group, engines, comms, prompt, sampling, device, interleave)
        traces = [_profile(p, e, prompt, sampling, c, rank) if p.profile_dir else None
                  for p, e, c in zip(group, engines, comms)]
        if rank != 0:
            return None
        results = [_result(point, models[j], device, dtype, runs[j], comms[j])
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
    mine = [p.describe() for p in group]
    everyone = from_every_rank((mine, socket.gethostname()))
    for rank, (theirs, _) in enumerate(everyone):
        if theirs != mine:
            differ = sorted({k for a, b in zip(theirs, mine) for k in a if a[k] != b.get(k)}) or ["layouts"]
            raise RanksDisagree(f"rank {rank} and rank {dist.get_rank()} are about to measure different "
                                f"configurations (they differ in {', '.join(differ)}): start every node with "
                                "the same command")
    return [host for _, host in everyone]


def generate_in_turns(engines: Sequence[Engine], prompt: torch.Tensor, gen_len: int, sampling: SamplingParams,
                      shift: int = 0) -> list[GenerationResult]:
    """One generation per engine (one per layout, each with its own KV cache), stepped in turns: every
    prefill, then every first decode step, and so on, each turn in its own order (`turn_order`). Each
    result times only its own steps."""
    clock = StepClock(engines[0].device)
    generations = [engine.start(prompt, gen_len, sampling, clock=clock) for engine in engines]
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


def build_models(group: Sequence[BenchPoint], comms: Sequence[Any], device: torch.device) -> list[Transformer]:
    """One model per point (layout), every one computing with one set of weights (`share_weights`), held
    by a layout with every parameter (parallel, with one norm per layer, has fewer) whatever the order
    of the layouts: measured in turns, layouts on different weights would start with caches that
    differ. Random weights are drawn in this rank's shard (`ModelSpec.load`, not exact)."""
    configs = [point.config() for point in group]
    models: dict[int, Transformer] = {}
    owners: list[Transformer] = []  # the models that hold a set of weights
    for i in sorted(range(len(group)), key=lambda i: configs[i].layout == "parallel"):
        shared = (share_weights(configs[i], comms[i], owner) for owner in owners)
        model = next((m for m in shared if m is not None), None)
        if model is None:
            model = group[i].model_spec().load(comms[i], device, exact=False).model
            owners.append(model)
        models[i] = model
    return [models[i] for i in range(len(group))]


def trace_name(point: BenchPoint, rank: int) -> str:
    layout = point.layout if point.ladder_layers is None else f"{point.layout}{point.ladder_layers}"
    link = point.interconnect + (f"-x{point.link_scale:g}" if point.emulated and point.link_scale != 1 else "")
    return f"{point.preset}-{layout}-tp{point.tp}-bs{point.batch_size}-{link}-rank{rank}.json"


def _profile(point: BenchPoint, engine: Any, prompt: torch.Tensor, sampling: Any, comm: object,
             rank: int) -> dict[str, Any]:
    """One extra short generation under the profiler (not part of the measured runs): its trace, and
    the share of communication time during which compute ran, read back from the trace."""
    path = Path(point.profile_dir) / trace_name(point, rank)
    max_seq = point.prompt_len + max(point.gen_len, point.profile_tokens)  # the measured runs' if it fits
    events = profile_generation(engine, prompt, point.profile_tokens, sampling, comm, path, max_seq)
    return {"path": str(path), "new_tokens": point.profile_tokens, "link": link_overlap(events)}


def _result(point: BenchPoint, model: Transformer, device: torch.device, dtype: str, runs: list,
            comm: object) -> dict[str, Any]:
    config = model.config
    prefill = [r.prefill_s for r in runs]
    decode = [r.decode_s for r in runs]
    latencies = sorted(t for r in runs for t in r.token_latencies_s)
    tokens_per_s = [point.batch_size * point.gen_len / (p + d) for p, d in zip(prefill, decode)]
    step_s = statistics.median(latencies) if latencies else float("nan")
    # Bytes one decode step must read: this rank's weights plus the KV cache at mid-generation.
    weights = weight_bytes(model)
    mid_len = point.prompt_len + point.gen_len // 2
    kv_bytes = kv_cache_bytes(config, model.shard.n_kv_heads, point.batch_size, mid_len, DTYPE_BYTES[dtype])
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
        "decode_token_latency_ms": percentiles([t * 1e3 for t in latencies]),
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "weight_bytes_per_rank": weights,
        "achieved_bandwidth_gbps": (weights + kv_bytes) / step_s / 1e9,
        "env": environment(device),
    }
    # With CUDA graphs the emulated link's ops run on the host only when a graph is captured, not at
    # each replay: the host cannot count them.
    graphed = point.decode_step.compiles_step or point.decode_step.captures_cuda_graph
    if isinstance(comm, EmulatedCommunicator) and not (graphed and device.type == "cuda"):
        result["modelled_comm_s_per_run"] = comm.modelled_s / max(point.runs, 1)
        result["all_reduces_per_run"] = comm.count // max(point.runs, 1)
        result["exposed_comm_s_per_run"] = comm.exposed_s / max(point.runs, 1)
        result["hidden_in_run"] = comm.hidden_fraction
    return result

