"""What ladder's eager int8 path buys over torchao's (`ladder.cpu.linears.Int8RowLinear`): SmolLM2 (random
weights) in bf16 (or --dtype) with int8 weights, eager, a prefill of B prompts of P tokens and a decode step at batch B, with
torchao's eager linear (the weight cast each call), torch's int8 kernel alone, and the kernel with
prefills dequantized (ladder's default), medians of a few calls.

    PYTHONPATH=src .venv/bin/python experiments/investigations/int8_eager.py [--batches 1,8] [--prompt-len 64]
        [--dtype bfloat16|float32]
"""

import argparse
import functools

import torch

from ladder.comm.base import LocalCommunicator
import ladder.cpu.linears as packing
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine
from timing import median_ms  # (this folder: first on sys.path when a script runs)

NEVER = 10**9


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model = ModelSpec(preset="smollm2-135m", device="cpu", dtype=args.dtype, quantize="int8").load(
        LocalCommunicator(), torch.device("cpu"), exact=False).model
    dequantize_from = packing.INT8_DEQUANTIZE_MIN_ROWS
    paths = {"torchao eager": (False, NEVER), "int8 kernel": (True, NEVER),
             f"kernel, dequantized from {dequantize_from} rows": (True, dequantize_from)}
    for batch in map(int, args.batches.split(",")):
        engine = Engine(model, DecodeStep.EAGER)
        engine.reserve(batch, args.prompt_len + 64)
        prompts = torch.randint(0, 1000, (batch, args.prompt_len))
        for label, (int8_rows, min_rows) in paths.items():
            # torchao's layers, or `Int8RowLinear` as an eager engine's view has them
            packing.convert_linears(engine.model, functools.partial(torchaos_or_int8_rows, int8_rows=int8_rows))
            packing.INT8_DEQUANTIZE_MIN_ROWS = min_rows
            prefill = median_ms(lambda: engine.prefill_prompts(prompts), 3)
            decode = median_ms(lambda: engine.decode([1] * batch, [args.prompt_len] * batch), 15)
            print(f"batch {batch:2d}  {label:34s} prefill {prefill:7.0f} ms  decode step {decode:6.1f} ms", flush=True)
        packing.INT8_DEQUANTIZE_MIN_ROWS = dequantize_from


if __name__ == "__main__":
    main()
