"""Where a start of `ladder serve --compile-layers` spends its time before it is ready, in one process (no HTTP
server): the imports, the model's load, the engine and its KV cache, then the warm-up shape by shape (with the
graphs made so far) and torch's compile timers. Then every shape again through the whole depth, timed: no
graph may be made there (error_on_recompile). Run it twice: the second run reads the graphs from torch's cache
(LADDER_CACHE_DIR/inductor).

    PYTHONPATH=src .venv/bin/python experiments/investigations/serve_start.py [ladder serve arguments]
"""

import time

START = time.perf_counter()

import argparse  # noqa: E402 (the imports are timed)
import sys  # noqa: E402

import torch  # noqa: E402

TORCH_S = time.perf_counter() - START

from ladder.cli import serve as serve_command  # noqa: E402
from ladder.cli.common import decode_step, model_spec  # noqa: E402
from ladder.comm.distributed import init_distributed  # noqa: E402
from ladder.runtime.engine import Engine  # noqa: E402
from ladder.serve.worker import ServeSettings, _kv_cache_plan, serving_options  # noqa: E402

DEFAULT = ["--model", "smollm2-135m-instruct", "--quantize", "int8", "--compile-layers"]
TIMERS = ["bytecode_tracing", "OutputGraph.call_user_compiler", "AOTAutogradCache.inductor_load", "build_guards"]


def main() -> None:
    parser = argparse.ArgumentParser()
    serve_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *(sys.argv[1:] or DEFAULT)])
    spec = model_spec(args)
    spec.validate()
    settings = ServeSettings(spec, "start", decode_step=decode_step(args))
    print(f"import torch {TORCH_S:.2f} s, with ladder's serve {time.perf_counter() - START:.2f} s")
    ctx = init_distributed(spec.device)
    started = time.perf_counter()
    plan = _kv_cache_plan(settings, ctx, ctx.device)
    loaded = spec.load(ctx.communicator(), ctx.device, exact=True)
    loaded_s = time.perf_counter() - started
    engine = Engine(loaded.model, serving_options(settings.decode_step))
    engine.reserve(plan.rows, plan.max_model_len, padded=True)
    print(f"plan and load {loaded_s:.2f} s, engine and KV cache {time.perf_counter() - started - loaded_s:.2f} s")

    from torch._dynamo.utils import compilation_time_metrics, counters

    shapes, last = engine.shapes, [time.perf_counter()]

    def on_shape(done: int, of: int) -> None:
        now = time.perf_counter()
        print(f"  warm-up batch {shapes[done - 1][0]}, cache {shapes[done - 1][1]}: {now - last[0]:.2f} s, "
              f"{counters['stats']['unique_graphs']} graphs", flush=True)
        last[0] = now
    warm_up_started = time.perf_counter()
    engine.warm_up(on_shape)
    print(f"warm-up {time.perf_counter() - warm_up_started:.2f} s; ready {time.perf_counter() - START:.2f} s "
          "after the start")
    for name in TIMERS:
        print(f"  {name}: {sum(compilation_time_metrics.get(name, [])):.2f} s")
    made = counters["stats"]["unique_graphs"]
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for batch, kv_len in shapes:
            step_started = time.perf_counter()
            engine._step_at(batch, kv_len)(torch.zeros(batch, 1, dtype=torch.long),
                                           torch.full((batch, 1), engine.scratch_position))
            print(f"  a step through every layer, batch {batch}, cache {kv_len}: "
                  f"{(time.perf_counter() - step_started) * 1e3:.0f} ms")
    print(f"graphs made after the warm-up: {counters['stats']['unique_graphs'] - made}")


if __name__ == "__main__":
    main()
