"""Does the compiled decode step keep ladder's overlap? Eager against torch.compile of the whole step
(`--compile`) and of each layer (`--compile-layers`), on an emulated link.

Rank 0's TP-4 shard of the llama-160m shape decodes on this CPU; every all-reduce is an emulated
transfer of 300 us + bytes / 10 GB/s. For each layout and mode it prints the decode time per token and
the share of the modelled transfers already over when compute asked for their result (hidden in run:
ladder high, standard near zero). That share is measured inside each run; the times compare runs made
one after another, and this shared 2-core machine drifts by 10-20 % between them. (How long compiling
takes: experiments/investigations/compile_time.py.)

    .venv/bin/python experiments/investigations/compiled_overlap.py [--layers 12] [--tokens 33]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.links import LinkModel
from ladder.model.config import get_preset
from ladder.model.weights import random_model
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine

LINK = LinkModel("custom", latency_us=300.0, bandwidth_gbps=10.0)
MODES = {"eager": {}, "compiled": {"compile": True}, "layers": {"compile_layers": True}}


def measure(layout: str, mode: str, layers: int, tokens: int, repeats: int) -> tuple[float, float | None]:
    """(median decode ms per token, hidden in run) of one layout in one mode."""
    cpu = torch.device("cpu")
    comm = EmulatedCommunicator(LINK, world_size=4, device=cpu)
    config = get_preset("llama-160m", layout=layout).replace(n_layers=layers)
    engine = Engine(random_model(config, comm, cpu), DecodeStep.from_flags(**MODES[mode]))
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    engine.generate(prompt, tokens)  # warm-up (and compilation)
    comm.reset_counters()
    per_token_ms = []
    for _ in range(repeats):
        result = engine.generate(prompt, tokens)
        per_token_ms.append(result.decode_s / (tokens - 1) * 1e3)
    return statistics.median(per_token_ms), comm.hidden_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="standard,ladder,upper-bound")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    print(f"llama-160m shape, {args.layers} layers, TP-4 shard of rank 0, emulated link "
          f"{LINK.latency_us:.0f} us + bytes / {LINK.bandwidth_gbps:.0f} GB/s; median of {args.repeats} runs")
    print(f"{'layout':<12} {'mode':<9} {'decode ms/token':>16} {'hidden in run':>14}")
    for layout in args.layouts.split(","):
        for mode in args.modes.split(","):
            ms, hidden = measure(layout, mode, args.layers, args.tokens, args.repeats)
            shown = "" if hidden is None else f"{hidden:.2f}"
            print(f"{layout:<12} {mode:<9} {ms:>16.2f} {shown:>14}", flush=True)


if __name__ == "__main__":
    main()
