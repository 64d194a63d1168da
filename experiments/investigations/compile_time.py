"""How long compiling takes, against the model's depth: the whole decode step (`--compile`) against each
layer once for all layers (`--compile-layers`).

For each depth and mode a fresh process (with a fresh inductor cache folder: nothing compiled before is
reused) builds the llama-160m shape with that many layers, ladder layout, TP-4 shard of rank 0 on an
emulated link, and times its first generation (compiling included) and its second (compiled already);
the difference is the compile time. The 70B shard has 80 layers.

    .venv/bin/python experiments/investigations/compile_time.py [--layers 2,8,32] [--modes compile,compile_layers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(layers: int, mode: str) -> dict[str, float]:
    """In this process: the first and second generation's seconds."""
    import torch

    from ladder.model.config import get_preset
    from ladder.options import DecodeStep
    from ladder.runtime.engine import Engine
    from ladder.comm.emulated import EmulatedCommunicator
    from ladder.comm.links import get_link
    from ladder.model.weights import random_model

    cpu = torch.device("cpu")
    config = get_preset("llama-160m", layout="ladder").replace(n_layers=layers)
    comm = EmulatedCommunicator(get_link("nvlink-h100"), world_size=4, device=cpu)
    engine = Engine(random_model(config, comm, cpu), DecodeStep.from_flags(**{mode: True}))
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        engine.generate(prompt, 8)
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "second_s": times[1]}


def in_fresh_process(layers: int, mode: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        out = subprocess.run([sys.executable, __file__, "--one", f"{layers},{mode}"], capture_output=True, text=True,
                             env=os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8,32", help="comma-separated depths")
    parser.add_argument("--modes", default="compile,compile_layers")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # LAYERS,MODE: measure in this process
    args = parser.parse_args()
    if args.one:
        layers, mode = args.one.split(",")
        print(json.dumps(one(int(layers), mode)))
        return
    print("llama-160m shape, ladder, TP-4 shard of rank 0 (emulated link); a fresh process and inductor cache each")
    print(f"{'layers':>6} {'mode':<15} {'compile s':>10} {'first run s':>12} {'second run s':>13}")
    for layers in map(int, args.layers.split(",")):
        for mode in args.modes.split(","):
            t = in_fresh_process(layers, mode)
            print(f"{layers:>6} {mode:<15} {t['first_s'] - t['second_s']:>10.1f} {t['first_s']:>12.1f} "
                  f"{t['second_s']:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
