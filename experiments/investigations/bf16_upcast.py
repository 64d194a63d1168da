"""What multiplying bf16 linear layers in fp32 buys on a CPU without bf16 arithmetic (`ladder.cpu.linears.UpcastLinear`):
SmolLM2's eager engine (random weights) in bf16 with the upcast off and on, and in fp32 (packed weights),
a prefill of B prompts of 64 tokens and a decode step at batch B, medians of a few calls.

    PYTHONPATH=src .venv/bin/python experiments/investigations/bf16_upcast.py [--batches 1,8,16]
"""

import argparse

import torch

from ladder.comm.base import LocalCommunicator
import ladder.cpu.linears as linears
from ladder.model.config import cpu_computes_in_bf16
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine
from timing import median_ms  # (this folder: first on sys.path when a script runs)

NEVER = 10**9  # an UPCAST_MIN_ROWS that no step reaches: the upcast off


def prefill_and_decode_ms(model: torch.nn.Module, batch: int) -> tuple[float, float]:
    engine = Engine(model, DecodeStep.EAGER)
    engine.reserve(batch, 192)
    prompts = torch.randint(0, 1000, (batch, 64))
    prefill = median_ms(lambda: engine.prefill_prompts(prompts), 3)
    decode = median_ms(lambda: engine.decode([1] * batch, [64] * batch), 15)
    return prefill, decode


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,16")
    args = parser.parse_args()
    print(f"CPU computes in bf16: {cpu_computes_in_bf16()}; upcast from {linears.UPCAST_MIN_ROWS} rows")
    device = torch.device("cpu")
    models = {dtype: ModelSpec(preset="smollm2-135m", device="cpu", dtype=dtype).load(
        LocalCommunicator(), device, exact=False).model for dtype in ("bfloat16", "float32")}
    upcast_from = linears.UPCAST_MIN_ROWS
    for batch in map(int, args.batches.split(",")):
        for label, dtype, min_rows in (("bf16, upcast off", "bfloat16", NEVER),
                                       ("bf16, upcast always", "bfloat16", 1),
                                       ("fp32", "float32", upcast_from)):
            linears.UPCAST_MIN_ROWS = min_rows
            prefill, decode = prefill_and_decode_ms(models[dtype], batch)
            print(f"batch {batch:2d}  {label:19s} prefill {prefill:7.0f} ms  decode step {decode:6.1f} ms", flush=True)
        linears.UPCAST_MIN_ROWS = upcast_from


if __name__ == "__main__":
    main()
