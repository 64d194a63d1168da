"""The whole compiled CPU decode step (`--compile`, weights by handle) with the cache length static (a graph a
shape, as a server makes them) or symbolic (one graph a batch size): graphs made and step times, SmolLM2 bf16,
batch 8, cache lengths 64-512. The symbolic one needs the layer regions off (dynamo's `stamp_out_subgraph`
fails on it), ints symbolic (`dynamic=True`) with the batch marked static, and floats specialised.

    PYTHONPATH=src LADDER_CACHE_DIR=off .venv/bin/python experiments/investigations/symbolic_cache_length.py static
    PYTHONPATH=src LADDER_CACHE_DIR=off .venv/bin/python experiments/investigations/symbolic_cache_length.py symbolic
"""

import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters

import ladder.model.transformer as transformer
import ladder.runtime.engine as engine_module
from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep, RuntimeOptions
from ladder.runtime import compile as compile_module

SYMBOLIC = sys.argv[1:] == ["symbolic"]
CACHE_LENGTHS = (64, 128, 256, 512)


def symbolic_cache_length() -> None:
    """Patch the step's compile to dynamic=True, the batch static, and the layer regions plain functions."""
    torch._dynamo.config.specialize_float = True
    plain_compile, plain_forward = torch.compile, engine_module.decode_forward

    def compile_step(fn, **settings):
        if settings.get("dynamic") is False and settings.get("isolate_recompiles"):
            settings["dynamic"] = True
        return plain_compile(fn, **settings)

    def forward(model, tokens, positions, kv_len, rows_as_slice=False):
        torch._dynamo.mark_static(tokens, 0)
        torch._dynamo.mark_static(positions, 0)
        return plain_forward(model, tokens, positions, kv_len, rows_as_slice)
    compile_module.torch.compile, engine_module.decode_forward = compile_step, forward
    for name in ("attention_region", "mlp_region", "parallel_region"):
        setattr(transformer, name, getattr(transformer, name).__marked_compile_region_fn__)


def main() -> None:
    if SYMBOLIC:
        symbolic_cache_length()
    with torch.inference_mode():
        model = ModelSpec(model="smollm2-135m-instruct", dtype="bfloat16", device="cpu").load(
            LocalCommunicator(), torch.device("cpu")).model
        engine = engine_module.Engine(model, RuntimeOptions(DecodeStep.COMPILED, cpu_gemm_templates=False))
        engine.reserve(8, 512, padded=True)
        tokens = torch.zeros(8, dtype=torch.long)
        for kv_len in CACHE_LENGTHS:
            start = time.perf_counter()
            engine.decode(tokens, [kv_len - 10] * 8)
            print(f"cache {kv_len}: first step {time.perf_counter() - start:.1f} s", flush=True)
        print("graphs made:", counters["stats"]["unique_graphs"])
        for kv_len in CACHE_LENGTHS:
            times = []
            for _ in range(20):
                start = time.perf_counter()
                engine.decode(tokens, [kv_len - 10] * 8)
                times.append(time.perf_counter() - start)
            print(f"cache {kv_len}: step {statistics.median(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
