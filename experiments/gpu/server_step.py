"""The server's decode step against `ladder generate`'s, on one engine in one process: `ladder serve`'s
plan (`run_plan`, the shapes reserved padded: powers of two, each captured as a CUDA graph) and
`Engine.decode` at `ladder generate`'s and `ladder bench`'s one shape (the batch, the whole cache), on
the same random-weight shard, batch B, every row at the same cache position. Both time the forward that
gives the step's logits; sampling is outside both. One JSON line per decode step.

Usage: python experiments/gpu/server_step.py --preset llama-3-8b --batch 8 --position 1024 \
           --out results/gpu/h200/server-step.jsonl
(scripts/gpu_checks.sh runs it; --device cpu --preset tiny --step eager is a dry run.)"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ladder.bench.records import append_jsonl, environment
from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine
from ladder.runtime.step_clock import synchronize
from ladder.serve.steps import StepPlan, run_plan

STEPS = {"cuda-graph": DecodeStep.CUDA_GRAPH, "compiled-layers-cuda-graph": DecodeStep.COMPILED_LAYERS_CUDA_GRAPH,
         "eager": DecodeStep.EAGER}


def step_ms(step: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Each call's time, synchronised, after three untimed ones."""
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--layout", default="standard")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--position", type=int, default=1024, help="the cache position every row decodes at")
    parser.add_argument("--step", choices=STEPS, default="cuda-graph")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device, step = torch.device(args.device), STEPS[args.step]
    spec = ModelSpec(preset=args.preset, layout=args.layout, device=args.device)
    model = spec.load(LocalCommunicator(), device, exact=False).model
    max_len = args.position + 64
    engine = Engine(model, step)
    engine.reserve(args.batch, max_len)  # ladder generate's one shape
    engine.prefill_prompts(torch.ones(args.batch, args.position, dtype=torch.long, device=device))
    tokens, positions = [1] * args.batch, [args.position] * args.batch
    engine_ms = step_ms(lambda: engine.decode(tokens, positions), device, args.repeats)

    engine.reserve(args.batch, max_len, padded=True)  # the server's shapes
    engine.warm_up()  # (writes only the scratch position: the prefill above stays)
    plan = StepPlan(decode_tokens=tokens, decode_positions=positions)
    server_ms = step_ms(lambda: run_plan(engine, plan), device, args.repeats)
    record = {"preset": args.preset, "layout": args.layout, "batch": args.batch, "position": args.position,
              "decode_step": step.value, "dtype": spec.dtype_name(device),
              "engine_ms_p50": statistics.median(engine_ms), "server_ms_p50": statistics.median(server_ms),
              "engine_ms": engine_ms, "server_ms": server_ms, "env": environment(device)}
    record["server_over_engine"] = record["server_ms_p50"] / record["engine_ms_p50"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    append_jsonl(args.out, record)
    print(f"{args.preset} {args.layout} batch {args.batch} at position {args.position}, {step.value}: "
          f"engine {record['engine_ms_p50']:.2f} ms, server {record['server_ms_p50']:.2f} ms "
          f"(x{record['server_over_engine']:.3f})", flush=True)


if __name__ == "__main__":
    main()
