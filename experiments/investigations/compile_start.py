"""Where a start of `ladder generate --compile` spends its time before the first token: the imports it
pays (torch, ladder's command, torch._dynamo, torchao, torch._inductor, each in a fresh process), then one
`ladder generate` run in this process with torch's compile timers (dynamo's trace, the backend with
AOTAutograd's cache, guards). Run it twice: the second run reads the step from torch's cache.

    PYTHONPATH=src .venv/bin/python experiments/investigations/compile_start.py [ladder generate arguments]
"""

import subprocess
import sys
import time

import torch

from ladder.cli.main import main as ladder

IMPORTS = ["torch", "ladder.cli.main, ladder.cli.generate", "torch._dynamo", "torchao.quantization",
           "torch._inductor.compile_fx"]
TIMERS = ["bytecode_tracing", "invoke_subgraph_trace", "invoke_subgraph_reuse_stamp_out",
          "OutputGraph.call_user_compiler", "AOTAutogradCache.inductor_load", "build_guards"]
DEFAULT = ["--model", "smollm2-135m-instruct", "--prompt", "Tell me, in a few sentences, how a bicycle's gears work:",
           "--max-new-tokens", "8", "--quantize", "int8", "--compile"]


def import_seconds() -> list[tuple[str, float]]:
    """Each module's import time after the ones before it, in one fresh process."""
    code = "import time\n" + "".join(f"t = time.perf_counter(); import {m}; print(time.perf_counter() - t)\n"
                                     for m in IMPORTS)
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return list(zip(IMPORTS, map(float, said)))


def main() -> None:
    for module, seconds in import_seconds():
        print(f"import {module}: {seconds:.2f} s")
    start = time.perf_counter()
    ladder(["generate", *(sys.argv[1:] or DEFAULT)])
    print(f"ladder generate in this process: {time.perf_counter() - start:.1f} s")
    timers = torch._dynamo.utils.compilation_time_metrics
    for name in TIMERS:
        runs = timers.get(name, [])
        print(f"{name}: {sum(runs):.2f} s ({len(runs)} times)")


if __name__ == "__main__":
    main()
