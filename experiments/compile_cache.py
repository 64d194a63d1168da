"""A compiled step's start, cold and from torch's own caches (`LADDER_CACHE_DIR/inductor`).

For each case, a first start with that folder made empty, then a second start that reads what the first
left there, as a user makes it: `ladder generate` with another prompt (of another length). For `ladder
generate`, its own "compiled in" line, the seconds from the command started to its first token printed, and
the decode rate after the compile; for `ladder serve`, the seconds until its /health says 200 (every step
shape made). Then the folder's size. One machine, one run, cases in turn.

    .venv/bin/python experiments/compile_cache.py

Writes results/compile_cache/{avx512-bf16,avx2}.{jsonl,md}, by this CPU's kind (`--case NAME`, repeated:
replaces only those cases' records).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ladder.bench.records import environment
from ladder.bench.serve_load import StartedServer, free_port
from ladder.model.config import cpu_computes_in_bf16

MODEL = "smollm2-135m-instruct"
PROMPT = "A short history of the printing press:"
ANOTHER_PROMPT = "Tell me, in a few sentences, how a bicycle's gears work:"  # another length: the second start
GENERATE = ["generate", "--model", MODEL, "--prompt", PROMPT, "--max-new-tokens", "96"]
CASES = {  # name: (ladder arguments, extra environment)
    "generate --quantize int8 --compile": (GENERATE + ["--quantize", "int8", "--compile"], {}),
    "generate --quantize int8 --compile, GEMM templates": (GENERATE + ["--quantize", "int8", "--compile"],
                                                           {"LADDER_CPU_GEMM_TEMPLATES": "1"}),
    "generate --quantize int8 --compile, no GEMM templates": (GENERATE + ["--quantize", "int8", "--compile"],
                                                              {"LADDER_CPU_GEMM_TEMPLATES": "0"}),
    "generate --dtype bfloat16 --compile": (GENERATE + ["--dtype", "bfloat16", "--compile"], {}),
    "generate --dtype bfloat16 --compile, GEMM templates": (GENERATE + ["--dtype", "bfloat16", "--compile"],
                                                            {"LADDER_CPU_GEMM_TEMPLATES": "1"}),
    "generate --dtype bfloat16 --compile, no GEMM templates": (GENERATE + ["--dtype", "bfloat16", "--compile"],
                                                               {"LADDER_CPU_GEMM_TEMPLATES": "0"}),
    "generate --quantize int8 --compile-layers": (GENERATE + ["--quantize", "int8", "--compile-layers"], {}),
    "serve --quantize int8 --compile-layers": (["serve", "--model", MODEL, "--quantize", "int8", "--compile-layers"],
                                               {}),
    "serve (its default step: compiled layers on a CPU)": (["serve", "--model", MODEL], {}),
}


def run_generate(arguments: list[str], env: dict[str, str]) -> dict:
    """One `ladder generate`: seconds to its first token on stdout, its compile and decode-rate lines."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ladder", *arguments], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr))
    reader.start()
    first_token_s = None
    while char := proc.stdout.read(1):
        if first_token_s is None and not char.isspace():
            first_token_s = time.perf_counter() - start
    proc.wait()
    reader.join()
    text = "".join(said)
    if proc.returncode != 0:
        raise RuntimeError(f"ladder {' '.join(arguments)} failed: {text[-2000:]}")
    compiled = re.search(r"compiled in ([\d.]+) s", text)
    rate = re.search(r"decode ([\d.]+) tokens/s", text)
    return {"first_token_s": first_token_s, "compile_s": float(compiled.group(1)) if compiled else None,
            "decode_tokens_per_s": float(rate.group(1)), "total_s": time.perf_counter() - start}


def run_serve(arguments: list[str], env: dict[str, str]) -> dict:
    """One `ladder serve`: seconds from its start until /health says 200."""
    port = free_port()
    server = StartedServer([sys.executable, "-m", "ladder", *arguments, "--port", str(port)], port,
                           f"ladder {' '.join(arguments)}")
    start = time.perf_counter()
    saved = dict(os.environ)
    os.environ.update(env)  # StartedServer starts its process with this process's environment
    try:
        with server:
            ready_s = time.perf_counter() - start
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"ready_s": ready_s}


def folder_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="default: results/compile_cache/avx512-bf16.jsonl or avx2.jsonl, by this CPU")
    parser.add_argument("--case", action="append", dest="cases",
                        help="a name of CASES, repeated for more (default: all)")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="ladder-compile-cache-"))
    base = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    base.update(LADDER_CACHE_DIR=str(cache), OMP_NUM_THREADS=str(os.cpu_count()))
    unknown = [name for name in args.cases or () if name not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; known: {'; '.join(CASES)}")
    names = args.cases or list(CASES)
    run_generate(GENERATE[:-1] + ["1"], base)  # the GGUF converted into the cache before any case
    records = []
    for name in names:
        arguments, extra = CASES[name]
        env = {**base, **extra}
        run = run_serve if arguments[0] == "serve" else run_generate
        shutil.rmtree(cache / "inductor", ignore_errors=True)
        cold = run(arguments, env)
        warm = run([ANOTHER_PROMPT if a == PROMPT else a for a in arguments], env)
        record = {"case": name, "cold": cold, "warm": warm, "cache_mib": folder_mib(cache / "inductor")}
        records.append(record)
        print(json.dumps(record), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    kind = "AVX-512 BF16 or AMX" if cpu_computes_in_bf16() else "no bf16 arithmetic (AVX2)"
    meta = {"model": MODEL, "cpu_kind": kind, "cores": os.cpu_count(), "env": environment(torch.device("cpu"))}
    out = Path(args.out or f"results/compile_cache/{'avx512-bf16' if cpu_computes_in_bf16() else 'avx2'}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    ran = {r["case"] for r in records}  # a run of some cases replaces only their records
    kept = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    records = [r for r in kept if r["case"] not in ran and r["case"] in CASES] + [{**r, **meta} for r in records]
    records.sort(key=lambda r: list(CASES).index(r["case"]))
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = ["| case | compile s, empty cache / again | first token (or ready) s, empty / again | decode tok/s "
             "| cache MiB |", "|---|---|---|---|---|"]
    for r in records:
        cold, warm = r["cold"], r["warm"]
        if "ready_s" in cold:
            lines.append(f"| {r['case']} | | ready {cold['ready_s']:.1f} / {warm['ready_s']:.1f} | | {r['cache_mib']:.1f} |")
        else:
            lines.append(f"| {r['case']} | {cold['compile_s']:.1f} / {warm['compile_s']:.1f} | "
                         f"{cold['first_token_s']:.1f} / {warm['first_token_s']:.1f} | "
                         f"{cold['decode_tokens_per_s']:.1f} / {warm['decode_tokens_per_s']:.1f} | {r['cache_mib']:.1f} |")
    lines += ["", f"SmolLM2-135M-Instruct (GGUF, converted once before), 96 new tokens, batch 1; the second start "
              f"with another prompt. CPU: {kind}, {os.cpu_count()} cores. "
              "`.venv/bin/python experiments/compile_cache.py`."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
