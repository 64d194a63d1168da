"""Time to the first answer, as a user meets it: from the command typed to the first token printed.

Each command runs in a fresh process, `--rounds` times in turns; the clock starts before the process is
started and stops when its first byte of answer reaches stdout. ladder's first start converts the GGUF
into its cache (`ladder.checkpoint.cache`: a cache folder made empty for that run), later starts read it.
The compiled step (`--quantize int8 --compile`, ladder's fastest decode on a CPU) is timed from an empty
compile cache (`inductor/` in the same folder, made empty) and then from what that start left there.
transformers reads the same GGUF file each start (its own documented way: `gguf_file=`), and streams with
`TextStreamer`. With `--llama-cpp-python PYTHON` (an interpreter with llama-cpp-python, built apart: not
ladder's dependency), llama.cpp reads the same GGUF file and streams its chat completion (the GGUF's own
chat template, greedy, a thread per core).

    .venv/bin/python experiments/first_answer.py --rounds 3 [--llama-cpp-python /tmp/llama/bin/python]

Writes results/first_answer.{jsonl,md}: a record and a table per CPU kind (a run replaces its kind's).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ladder.bench.records import environment
from ladder.checkpoint.resolve import resolve_model
from ladder.model.config import cpu_computes_in_bf16

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
TRANSFORMERS = """
import sys, torch, transformers
path = sys.argv[1]
folder, name = path.rsplit("/", 1)
tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
ids = tokenizer.apply_chat_template([{"role": "user", "content": sys.argv[2]}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)
model.generate(**ids, max_new_tokens=8, do_sample=False,
               streamer=transformers.TextStreamer(tokenizer, skip_prompt=True))
"""
LLAMA_CPP = """
import os, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=os.cpu_count(), verbose=False)
for part in llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=8, temperature=0.0,
                                       stream=True):
    print(part["choices"][0]["delta"].get("content", ""), end="", flush=True)
"""


def cpu_description() -> str:
    """The CPU's model name and whether it has bf16 arithmetic (the two kinds these machines come in)."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").is_file() else []
    kind = "AVX-512 BF16 or AMX" if cpu_computes_in_bf16() else "no bf16 arithmetic (AVX2)"
    return f"{names[0] if names else 'unknown CPU'}, {kind}, {os.cpu_count()} cores"


def first_output_s(command: list[str], env: dict[str, str]) -> float:
    """Seconds from the start of `command` to its first byte on stdout (the run then finishes)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    while True:
        byte = proc.stdout.read(1)
        if not byte:
            raise RuntimeError(f"{command[:4]} printed nothing")
        if not byte.isspace():
            seconds = time.perf_counter() - start
            break
    proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"{command[:4]} failed")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/first_answer.jsonl")
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python installed (the CPU peer)")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="ladder-first-answer-"))
    env = {**os.environ, "LADDER_CACHE_DIR": str(cache), "OMP_NUM_THREADS": str(os.cpu_count())}
    ladder = [sys.executable, "-m", "ladder", "generate", "--model", MODEL, "--chat", QUESTION, "--max-new-tokens", "8"]
    compiled = ladder + ["--quantize", "int8", "--compile"]
    runs = {
        "ladder generate, first start (converts the GGUF)": lambda: shutil.rmtree(cache / "gguf", ignore_errors=True)
        or first_output_s(ladder, env),
        "ladder generate": lambda: first_output_s(ladder, env),
        "ladder generate --quantize int8 --compile, empty compile cache": lambda: shutil.rmtree(
            cache / "inductor", ignore_errors=True) or first_output_s(compiled, env),
        "ladder generate --quantize int8 --compile, again": lambda: first_output_s(compiled, env),
        "transformers generate (GGUF)": lambda: first_output_s(
            [sys.executable, "-c", TRANSFORMERS, str(resolve_model(MODEL)), QUESTION], env),
    }
    if args.llama_cpp_python:
        runs["llama.cpp (llama-cpp-python, the same GGUF)"] = lambda: first_output_s(
            [args.llama_cpp_python, "-c", LLAMA_CPP, str(resolve_model(MODEL)), QUESTION], env)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(run())
            print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    out = Path(args.out)
    record = {"model": MODEL, "question": QUESTION, "seconds": times, "cpu": cpu_description(),
              "env": environment(torch.device("cpu"))}
    kind = record["env"]["cpu_kind"]
    kept = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    records = sorted([r for r in kept if r["env"]["cpu_kind"] != kind] + [record], key=lambda r: r["env"]["cpu_kind"])
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = ["# Time to the first answer, a table per CPU kind", ""]
    for r in records:
        lines += table(r)
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(table(record)))


def table(record: dict) -> list[str]:
    """A CPU kind's section: each command's median and runs, and how they were measured."""
    times = record["seconds"]
    rounds = len(next(iter(times.values())))
    llama = any(name.startswith("llama.cpp") for name in times)
    lines = [f"## {record['env']['cpu_kind']}", "",
             "| command (SmolLM2-135M-Instruct GGUF, `--chat`, CPU) | first token printed, s (median) | runs |",
             "|---|---|---|"]
    lines += [f"| {name} | {statistics.median(t):.2f} | {', '.join(f'{x:.2f}' for x in t)} |" for name, t in times.items()]
    peer = (" llama.cpp computes on the GGUF's Q4_1 weights (ladder and transformers dequantize them to float32);"
            " its greedy answer differs." if llama else "")
    lines += ["", f"{rounds} rounds in turns; from the command started to its first byte of answer on stdout.{peer} "
              f"CPU: {record['cpu']}; commit {record['env'].get('git_commit', 'unknown')}. "
              f"`.venv/bin/python experiments/first_answer.py --rounds {rounds}"
              f"{' --llama-cpp-python PYTHON' if llama else ''}`.", ""]
    return lines


if __name__ == "__main__":
    main()
