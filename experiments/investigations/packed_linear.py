"""What packing the weights for oneDNN buys on this CPU (`ladder.cpu.linears`): SmolLM2's linear layers alone
at batch 1, 8 and 64, and the server's whole decode step at batch 8, plain (`F.linear`, MKL) and packed.

    .venv/bin/python experiments/investigations/packed_linear.py
"""

import time

import torch
import torch.nn.functional as F

from ladder.comm.base import LocalCommunicator
from ladder.cpu.linears import PackedLinear, convert_linears
from ladder.model.spec import ModelSpec
from ladder.runtime.engine import Engine, PrefillChunk
from ladder.serve.steps import StepPlan, run_plan


def per_call_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


@torch.inference_mode()
def main() -> None:
    model = ModelSpec(model="smollm2-135m-instruct", dtype="float32").load(LocalCommunicator(), torch.device("cpu")).model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [PackedLinear(m) for m in linears]
    for batch in (1, 8, 64):
        inputs = [torch.randn(batch, m.in_features) for m in linears]
        plain = per_call_ms(lambda: [F.linear(x, m.weight) for x, m in zip(inputs, linears)])
        fast = per_call_ms(lambda: [p(x) for x, p in zip(inputs, packed)])
        print(f"all {len(linears)} linear layers, batch {batch}: F.linear {plain:.1f} ms, packed {fast:.1f} ms")
    engine = Engine(model)
    engine.reserve(8, 512, padded=True)  # as the server does
    for row in range(8):
        run_plan(engine, StepPlan(prefill=[PrefillChunk(row, list(range(100, 164)), 0)]))
    step = lambda: run_plan(engine, StepPlan(decode_tokens=[5] * 8, decode_positions=[100] * 8))  # noqa: E731
    for label in ("packed", "plain"):
        print(f"server decode step, batch 8, {label}: {per_call_ms(step, 20):.1f} ms")
        convert_linears(engine.model, lambda layer: layer.unpacked() if isinstance(layer, PackedLinear) else layer)


if __name__ == "__main__":
    main()
