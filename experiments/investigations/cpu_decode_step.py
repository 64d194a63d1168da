"""What each change to the compiled CPU decode step buys: SmolLM2-135M-Instruct (the real weights), batch 1,
64 prompt tokens and 64 new ones over a cache of 256, compiled, each variant compiled in this one process
and then timed in turns (this machine's speed drifts over minutes). The variants put back, one at a time,
what the step did before:
- "all guards": dynamo checks every guard on the model each step (`ladder.runtime.compile.guards_off_the_model`
  drops them);
- "rope computed": cos and sin computed from the positions in the graph (`Transformer.cached_rope` reads
  them from tables);
- "ATen attention": the decode attention through ATen's flash kernel (`RuntimeOptions.decode_attention="sdpa"`),
  not `ladder.model.attention.decode_attention`.

    PYTHONPATH=src .venv/bin/python experiments/investigations/cpu_decode_step.py [--quantize int8] [--dtype bfloat16]
        [--rounds 4]
"""

import argparse
import dataclasses
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
import ladder.model.transformer as model_module
from ladder.options import DecodeStep, RuntimeOptions
import ladder.runtime.compile as compile_module
from ladder.runtime.engine import Engine
from ladder.runtime.sampling import SamplingParams

VARIANTS = {  # name: what it puts back
    "all guards, rope computed, ATen attention (before)": ("guards", "rope", "attention"),
    "all guards": ("guards",),
    "rope computed": ("rope",),
    "ATen attention": ("attention",),
    "rope computed, ATen attention": ("rope", "attention"),
    "now": (),
}


@contextlib.contextmanager
def put_back(changes: tuple[str, ...]) -> Iterator[None]:
    """The step as it was before the named changes, while tracing (the compiled graph keeps it)."""
    saved = (compile_module.guards_off_the_model, model_module.Transformer.cached_rope)
    if "guards" in changes:
        compile_module.guards_off_the_model = lambda guards: [True] * len(guards)
    if "rope" in changes:
        model_module.Transformer.cached_rope = model_module.Transformer.rope
    try:
        yield
    finally:
        compile_module.guards_off_the_model, model_module.Transformer.cached_rope = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    prompt = torch.randint(100, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    engines, tokens, steps = {}, {}, {}
    for name, changes in VARIANTS.items():
        spec = ModelSpec(model="smollm2-135m-instruct", dtype=args.dtype, quantize=args.quantize or None, device="cpu")
        with put_back(changes):
            model = spec.load(LocalCommunicator(), torch.device("cpu")).model
            options = RuntimeOptions.from_environment(DecodeStep.COMPILED)
            attention = "sdpa" if "attention" in changes else options.decode_attention
            engines[name] = Engine(model, dataclasses.replace(options, decode_attention=attention))
            tokens[name] = engines[name].generate(prompt, 16, greedy, max_seq=256).tokens  # compiles
        steps[name] = []
    for _ in range(args.rounds):
        for name, engine in engines.items():
            steps[name] += engine.generate(prompt, 64, greedy, max_seq=256).token_latencies_s
    first = next(iter(tokens.values()))
    print(f"SmolLM2, {args.dtype}, {args.quantize or 'unquantized'}, compiled, batch 1, {time.strftime('%Y-%m-%d')}")
    print("| step | median ms | p10 ms | greedy tokens as the first's |\n|---|---|---|---|")
    for name, times in steps.items():
        times.sort()
        print(f"| {name} | {statistics.median(times) * 1e3:.2f} | {times[len(times) // 10] * 1e3:.2f} | "
              f"{tokens[name] == first} |")


if __name__ == "__main__":
    main()
