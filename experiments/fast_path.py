"""The fast path a user takes: `--quantize int8` (eager, and with `--compile`) against fp32 eager at batch 1,
with the activation dtype and GEMM settings ladder picks on this CPU by itself, in one run, in turns.

One table per CPU kind (these machines have AVX-512 with bf16 arithmetic, or only AVX2): the results go
to results/fast_path/<kind>.{jsonl,md}, and a run on the other kind writes its own file.

    .venv/bin/python experiments/fast_path.py --rounds 2

The decode rate is the median step of two 128-token greedy generations after a 64-token prompt
(`experiments/quantization.py`'s `decode_speed`), once compiled where the step compiles.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from ladder.bench.records import cpu_kind, environment
from ladder.model.config import default_dtype
from ladder.options import DecodeStep
from quantization import decode_speed  # (experiments/ is the script's folder)

CASES = {  # name: (dtype, quantize, step); the dtype `ladder generate` picks for each
    "fp32 eager": ("float32", None, DecodeStep.EAGER),
    "--quantize int8": (None, "int8", DecodeStep.EAGER),
    "--quantize int8 --compile": (None, "int8", DecodeStep.COMPILED),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    kind = cpu_kind()
    rates: dict[str, list[float]] = {name: [] for name in CASES}
    dtypes = {}
    for _ in range(args.rounds):
        for name, (dtype, quantize, step) in CASES.items():
            dtypes[name] = dtype or default_dtype("cpu", quantize)
            row = decode_speed(dtypes[name], quantize, step)
            rates[name].append(row["tokens_per_s"])
            print(name, json.dumps(row), flush=True)
    base = statistics.median(rates["fp32 eager"])
    out = Path("results/fast_path") / kind
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu_kind": kind, "cores": os.cpu_count(), "tokens_per_s": rates, "dtypes": dtypes,
              "env": environment(torch.device("cpu"))}
    out.with_suffix(".jsonl").write_text(json.dumps(record) + "\n")
    lines = ["| command (SmolLM2-135M-Instruct, batch 1) | activations | tokens/s (median) | x fp32 eager | runs |",
             "|---|---|---|---|---|"]
    lines += [f"| {name} | {dtypes[name]} | {statistics.median(r):.1f} | {statistics.median(r) / base:.2f} | "
              f"{', '.join(f'{x:.1f}' for x in r)} |" for name, r in rates.items()]
    lines += ["", f"CPU kind: {kind}, {os.cpu_count()} cores; {args.rounds} rounds in turns. "
              "`.venv/bin/python experiments/fast_path.py`."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
