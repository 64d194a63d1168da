"""Quantized weights (`--quantize int8|int4`, torchao weight-only): what they cost in quality, what they
buy in speed on this CPU, and what they do to ladder's gain.

- quality: held-out Shakespeare and Python-docs perplexity of SmolLM2-135M-Instruct (GGUF) in standard,
  hybrid (ladder on the last 8 of 30 layers, what `ladder convert --ladder-layers 8` writes) and ladder
  (all 30 layers, not adapted), at TP 1 and TP 2 (two real gloo ranks): int8 against unquantized in fp32,
  int4 against unquantized in bf16 (torch's int4 CPU kernel takes 30x longer with fp32 activations: a
  512-token window 36 s, where bf16 takes 3 s);
- speed: batch-1 decoding of SmolLM2 in this process (ladder's `Engine`, what `ladder generate` runs),
  64 prompt and 128 new tokens, in each dtype, quantization and decode step, beside llama.cpp on the
  same GGUF (its own Q4_1 weights) when `--llama-cpp-python PYTHON` names an interpreter with
  llama-cpp-python;
- gain: `ladder bench` on the emulated pcie-no-p2p link, llama-160m at TP 4, standard, ladder and upper
  bound, batch 1 and 4, bf16 with compiled layers, unquantized, int8 and int4. The link is dilated once
  (to 25 % of the unquantized standard step: `--comm-share 0.25`) and that dilation is kept for the
  quantized runs, so the link costs the same while the compute shrinks, as on a real machine.

    .venv/bin/python experiments/quantization.py [--parts quality,answers,speed,memory,serve,gain] [--llama-cpp-python PATH]

Writes results/quantization/{quality,answers,speed}.jsonl, gain.jsonl (ladder bench's records) and report.md.
(answers: greedy chat answers of standard and hybrid-8 at TP 1 and 2 in each weight format; serve: the
engine-speed issue's burst load against `ladder serve` in each weight format, results/quantization/serve.jsonl;
memory: the peak of torch's CPU allocations while SmolLM2 loads and generates, against `ladder.runtime.memory`'s estimate,
results/quantization/memory.jsonl.)
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ladder.bench.summary import summarise
from ladder.checkpoint.resolve import resolve_model
from ladder.comm.base import LocalCommunicator
from ladder.comm.distributed import init_distributed, shutdown_distributed
from ladder.comm.launch import launch
from ladder.comm.links import get_links
from ladder.corpora import python_docs_text, shakespeare_text
from ladder.cpu.linears import weight_bytes
from ladder.evaluate import perplexity
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.predict.costmodel import get_gpu, predict_table
from ladder.quant.quantize import check_quantize
from ladder.runtime.engine import Engine
from ladder.runtime.memory import estimate_memory_bytes, peak_cpu_bytes
from ladder.runtime.sampling import SamplingParams

OUT = Path("results/quantization")
TEXTS = Path("runs/quantization")  # git-ignored: the held-out texts as files, for `ladder eval`'s request
MODEL = "smollm2-135m-instruct"
MODES = (None, "int8", "int4")
QUALITY = [("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int4")]  # (dtype, quantize)
LAYOUTS = {"standard": dict(layout="standard"), "hybrid-8": dict(ladder_layers=8), "ladder": dict(layout="ladder")}
EVAL_TOKENS, WINDOW = 2048, 512
SPEED_CONFIGS = [  # (dtype, quantize, decode step)
    ("float32", None, DecodeStep.EAGER), ("float32", None, DecodeStep.COMPILED), ("bfloat16", None, DecodeStep.EAGER),
    ("bfloat16", None, DecodeStep.COMPILED), ("float32", "int8", DecodeStep.EAGER),
    ("bfloat16", "int8", DecodeStep.EAGER), ("bfloat16", "int8", DecodeStep.COMPILED),
    ("bfloat16", "int4", DecodeStep.EAGER), ("bfloat16", "int4", DecodeStep.COMPILED),
    ("float32", "int4", DecodeStep.EAGER),  # (the kernels' fp32 paths: why quantized weights default to bf16 here)
]
GAIN = ("--preset llama-160m --interconnect pcie-no-p2p --tp 4 --layouts standard,ladder,upper-bound "
        "--batch-sizes 1,4 --prompt-len 64 --gen-len 32 --runs 3 --rounds 2 --interleave steps "
        "--dtype bfloat16 --compile-layers").split()


def label(mode: str | None) -> str:
    return mode or "unquantized"


def text_files() -> dict[str, Path]:
    TEXTS.mkdir(parents=True, exist_ok=True)
    files = {"shakespeare": TEXTS / "shakespeare-heldout.txt", "python-docs": TEXTS / "python-docs.txt"}
    files["shakespeare"].write_text(shakespeare_text("heldout"))
    files["python-docs"].write_text(python_docs_text())
    return files


def perplexities_on_rank(spec: ModelSpec, files: dict[str, Path]) -> dict[str, dict]:
    """One rank: load the model once, then each text's perplexity (`ladder eval`'s measure)."""
    ctx = init_distributed("cpu")
    try:
        loaded = spec.load(ctx.communicator(), ctx.device)
        return {text: perplexity(loaded.model, loaded.tokenizer.encode(path.read_text())[:EVAL_TOKENS], WINDOW,
                                 progress=False)
                for text, path in files.items()}
    finally:
        shutdown_distributed()


def quality() -> list[dict]:
    rows = []
    files = text_files()
    for tp in (1, 2):
        for layout, options in LAYOUTS.items():
            for dtype, mode in QUALITY:
                spec = ModelSpec(model=MODEL, dtype=dtype, tp=tp, quantize=mode, device="cpu", **options)
                for text, result in launch(perplexities_on_rank, tp, spec, files, device="cpu").get(0).items():
                    rows.append({"tp": tp, "layout": layout, "dtype": dtype, "quantize": label(mode), "text": text,
                                 "perplexity": result["perplexity"], "scored": result["n_scored"]})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "What does a Python list do?")


def answers_on_rank(spec: ModelSpec) -> list[str]:
    """One rank: greedy answers (32 tokens at most) to QUESTIONS, through the chat template."""
    ctx = init_distributed("cpu")
    try:
        loaded = spec.load(ctx.communicator(), ctx.device)
        tokenizer, engine = loaded.tokenizer, Engine(loaded.model)
        answers = []
        for question in QUESTIONS:
            ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": question}]), add_bos=False)
            result = engine.generate(torch.tensor([ids]), 32, SamplingParams(temperature=0), tokenizer.stop_ids)
            answers.append(tokenizer.decode([t for t in result.tokens[0] if t not in tokenizer.stop_ids]).strip())
        return answers
    finally:
        shutdown_distributed()


def answers() -> list[dict]:
    rows = []
    for tp in (1, 2):
        for layout in ("standard", "hybrid-8"):
            for dtype, mode in QUALITY:
                spec = ModelSpec(model=MODEL, dtype=dtype, tp=tp, quantize=mode, device="cpu", **LAYOUTS[layout])
                for question, answer in zip(QUESTIONS, launch(answers_on_rank, tp, spec, device="cpu").get(0)):
                    rows.append({"tp": tp, "layout": layout, "dtype": dtype, "quantize": label(mode),
                                 "question": question, "answer": answer})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def answers_table(rows: list[dict]) -> list[str]:
    lines = ["| TP | layout | weights | " + " | ".join(QUESTIONS) + " |", "|---|---|---|" + "---|" * len(QUESTIONS)]
    for key in dict.fromkeys((r["tp"], r["layout"], r["dtype"], r["quantize"]) for r in rows):
        said = [r["answer"].replace("\n", " ").replace("|", "/") for r in rows
                if (r["tp"], r["layout"], r["dtype"], r["quantize"]) == key]
        lines.append(f"| {key[0]} | {key[1]} | {key[3]} ({key[2]}) | " + " | ".join(said) + " |")
    return lines


def decode_speed(dtype: str, mode: str | None, step: DecodeStep) -> dict:
    spec = ModelSpec(model=MODEL, dtype=dtype, quantize=mode, device="cpu")
    model = spec.load(LocalCommunicator(), torch.device("cpu")).model
    engine = Engine(model, step)
    prompt = torch.randint(100, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    start = time.perf_counter()
    engine.generate(prompt, 8, greedy, max_seq=256)  # compiles a compiled step
    ready_s = time.perf_counter() - start
    steps = []
    for _ in range(2):
        steps += engine.generate(prompt, 128, greedy, max_seq=256).token_latencies_s
    step_s = statistics.median(steps)
    return {"engine": "ladder", "dtype": dtype, "quantize": label(mode), "step": step.value,
            "tokens_per_s": 1 / step_s, "step_ms": step_s * 1e3, "warmup_s": ready_s}


def llama_cpp_speed(python: str, when: str) -> dict:
    """llama.cpp (llama-cpp-python) on the GGUF ladder reads, 2 threads, 64 prompt and 128 new tokens."""
    gguf = resolve_model(MODEL)  # the GGUF file ladder reads
    script = f"""
import statistics, time
from llama_cpp import Llama
llm = Llama(model_path={str(gguf)!r}, n_ctx=256, n_threads=2, verbose=False)
prompt = list(range(100, 164))
times = []
for _ in range(3):
    llm.reset(); llm.eval(prompt)
    token = llm.sample(temp=0.0)
    for _ in range(128):
        start = time.perf_counter(); llm.eval([token]); token = llm.sample(temp=0.0)
        times.append(time.perf_counter() - start)
print(statistics.median(times))
"""
    out = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    step_s = float(out.stdout.strip().splitlines()[-1])
    return {"engine": f"llama.cpp ({when} ladder's rows)", "dtype": "Q4_1 (GGUF)", "quantize": "Q4_1",
            "step": "llama.cpp", "tokens_per_s": 1 / step_s, "step_ms": step_s * 1e3, "warmup_s": None}


def speed(llama_cpp_python: str | None) -> list[dict]:
    earlier = [r for r in read_jsonl(OUT / "speed.jsonl") if r["engine"].startswith("llama.cpp")]
    rows = [decode_speed(*config) for config in SPEED_CONFIGS]
    if llama_cpp_python:  # before and after ladder's rows: this machine's speed drifts over a run
        rows = [llama_cpp_speed(llama_cpp_python, "before"), *rows, llama_cpp_speed(llama_cpp_python, "after")]
    else:  # the last measured llama.cpp row, kept and marked as such
        rows += [{**r, "engine": r["engine"].removesuffix(" (earlier run)") + " (earlier run)"} for r in earlier]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


MEMORY_CONFIGS = [("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")]


def memory_peak(dtype: str, mode: str | None, step: DecodeStep) -> dict:
    """Peak of torch's CPU tensor bytes while SmolLM2 loads and generates (64 prompt and 64 new tokens,
    batch 1), against `ladder.runtime.memory`'s estimate of the same run."""
    spec = ModelSpec(model=MODEL, dtype=dtype, quantize=mode, device="cpu")
    config = spec.config()  # the header read, and torchao imported, before the measure
    check_quantize(mode, "cpu", getattr(torch, dtype))
    prompt = torch.randint(100, 40000, (1, 64), generator=torch.Generator().manual_seed(0))

    def run() -> int:
        model = spec.load(LocalCommunicator(), torch.device("cpu")).model
        Engine(model, step).generate(prompt, 64, SamplingParams(temperature=0), max_seq=128)
        return weight_bytes(model)

    peak, weights = peak_cpu_bytes(run)
    estimate = estimate_memory_bytes(config, 1, 1, 64, 128, getattr(torch, dtype).itemsize, quantize=mode,
                                     cpu_step=step)
    return {"dtype": dtype, "quantize": label(mode), "step": step.value, "peak_bytes": peak,
            "weight_bytes": weights, "estimate_bytes": estimate, "peak_over_estimate": peak / estimate}


def memory() -> list[dict]:
    rows = [memory_peak(dtype, mode, DecodeStep.EAGER) for dtype, mode in MEMORY_CONFIGS]
    rows += [memory_peak("bfloat16", mode, DecodeStep.COMPILED) for mode in (None, "int8", "int4")]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


SERVERS = {  # label: `ladder serve` options beyond the model and the README's --max-batch 8 --max-model-len 512
    "fp32 (README flags)": ["--eager"],  # eager, as recorded: a CPU server compiles its layers by default now
    "bf16, compiled layers": ["--dtype", "bfloat16", "--compile-layers"],
    "int8 bf16, compiled layers": ["--dtype", "bfloat16", "--quantize", "int8", "--compile-layers"],
    "int4 bf16, compiled layers": ["--dtype", "bfloat16", "--quantize", "int4", "--compile-layers"],
}
BURST = "--dataset fixed --prompt-len 64 --output-len 64 --num-requests 32 --request-rates inf --max-concurrency 8"


def serve() -> Path:
    """Engine-speed issue's burst (32 requests, 8 in flight, 64+64 tokens) against `ladder serve` with
    each weight format; bench serve starts each server and stops it."""
    out = OUT / "serve.jsonl"
    out.unlink(missing_ok=True)
    for name, options in SERVERS.items():
        served = " ".join(["--model", MODEL, "--max-batch", "8", "--max-model-len", "512", *options])
        subprocess.run([sys.executable, "-m", "ladder", "bench", "serve", "--serve", served, "--label", name,
                        *BURST.split(), "--out", str(out)], check=True)
    return out


def serve_table(path: Path) -> list[str]:
    lines = ["| server | output tok/s | inter-token ms (mean) | first token ms (p50) |", "|---|---|---|---|"]
    for r in read_jsonl(path):
        lines.append(f"| {r['label']} | {r['output_throughput']:.1f} | {r['itl_ms']['mean']:.1f} | "
                     f"{r['ttft_ms']['p50']:.0f} |")
    return lines


def gain() -> Path:
    """Unquantized with the link dilated to 25 % of standard's step, then int8 and int4 at that dilation."""
    out = OUT / "gain.jsonl"
    out.unlink(missing_ok=True)
    bench = [sys.executable, "-m", "ladder", "bench", *GAIN, "--out", str(out)]
    subprocess.run([*bench, "--comm-share", "0.25"], check=True)
    scales = {r["batch_size"]: r["link_scale"] for r in map(json.loads, out.read_text().splitlines())}
    for mode in MODES[1:]:
        for batch, scale in scales.items():
            subprocess.run([*bench, "--quantize", mode, "--batch-sizes", str(batch), "--link-scale", f"{scale:.6g}"],
                           check=True)
    return out


def predicted_gain() -> list[dict]:
    """The cost model's Llama-3-70B at TP 8 on an H100, bf16 against int8 and int4 block linears."""
    rows = []
    for link in get_links(["nvlink-h100", "pcie-no-p2p"], None, None):
        for mode in MODES:
            rows += predict_table("llama-3-70b", get_gpu("h100"), link, 8, [1, 4], ["standard", "ladder", "upper-bound"],
                                  1024, 512, quantize=mode)
    return rows


def quality_table(rows: list[dict]) -> list[str]:
    lines = ["| TP | layout | text | fp32 | int8 (fp32) | bf16 | int4 (bf16) |", "|---|---|---|---|---|---|---|"]
    ppl = {(r["tp"], r["layout"], r["text"], r["dtype"], r["quantize"]): r["perplexity"] for r in rows}
    for tp, layout, text in dict.fromkeys(key[:3] for key in ppl):
        cells = []
        for dtype, mode in (("float32", "int8"), ("bfloat16", "int4")):
            base, got = ppl[(tp, layout, text, dtype, "unquantized")], ppl[(tp, layout, text, dtype, mode)]
            cells += [f"{base:.3f}", f"{got:.3f} ({(got / base - 1) * 100:+.2f} %)"]
        lines.append(f"| {tp} | {layout} | {text} | " + " | ".join(cells) + " |")
    return lines


def speed_table(rows: list[dict]) -> list[str]:
    base = next(r["tokens_per_s"] for r in rows if r["dtype"] == "float32" and r["quantize"] == "unquantized")
    lines = ["| engine | dtype | weights | decode step | tokens/s | x fp32 eager | ready after (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ready = "" if r["warmup_s"] is None else f"{r['warmup_s']:.1f}"
        lines.append(f"| {r['engine']} | {r['dtype']} | {r['quantize']} | {r['step']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / base:.2f} | {ready} |")
    return lines


def memory_table(rows: list[dict]) -> list[str]:
    lines = ["| dtype | weights | decode step | peak (MB) | weights after load (MB) | estimate (MB) | peak / estimate |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['quantize']} | {r['step']} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['weight_bytes'] / 2**20:.1f} | {r['estimate_bytes'] / 2**20:.1f} | {r['peak_over_estimate']:.3f} |")
    return lines


def gain_table(path: Path) -> list[str]:
    rows = summarise(json.loads(line) for line in path.read_text().splitlines())
    lines = ["| weights | batch | standard tok/s | ladder tok/s | upper bound tok/s | comm. share of standard | "
             "ladder speedup | hidden |", "|---|---|---|---|---|---|---|---|"]
    by = {(r["quantize"], r["batch_size"], r["layout"]): r for r in rows}
    for batch, mode in sorted({(batch, mode) for mode, batch, _ in by}, key=lambda k: (k[0], MODES.index(k[1]))):
        ladder, standard, upper = (by[(mode, batch, layout)] for layout in ("ladder", "standard", "upper-bound"))
        share = 1 - standard["tokens_per_s"] / upper["tokens_per_s"]
        lines.append(f"| {label(mode)} | {batch} | {standard['tokens_per_s']:.1f} | {ladder['tokens_per_s']:.1f} | "
                     f"{upper['tokens_per_s']:.1f} | {share:.2f} | {ladder['speedup']:.3f} | "
                     f"{ladder['hidden']:.2f} |")
    return lines


def predicted_table(rows: list[dict]) -> list[str]:
    lines = ["| link | weights | batch | standard tok/s | ladder tok/s | ladder speedup | hidden |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["layout"] == "ladder":
            standard = next(s for s in rows if s["layout"] == "standard" and
                            (s["interconnect"], s["quantize"], s["batch_size"]) == (r["interconnect"], r["quantize"], r["batch_size"]))
            lines.append(f"| {r['interconnect']} | {label(r['quantize'])} | {r['batch_size']} | "
                         f"{standard['tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} | {r['speedup']:.3f} | {r['hidden']:.2f} |")
    return lines


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def report() -> None:
    sections = ["# Quantized weights on this CPU (experiments/quantization.py)", ""]
    if (OUT / "quality.jsonl").exists():
        sections += ["## Quality: perplexity of SmolLM2-135M-Instruct, "
                     f"first {EVAL_TOKENS} tokens of each text, windows of {WINDOW}", "",
                     *quality_table(read_jsonl(OUT / "quality.jsonl")), ""]
    if (OUT / "answers.jsonl").exists():
        sections += ["## Greedy chat answers (32 tokens at most)", "", *answers_table(read_jsonl(OUT / "answers.jsonl")), ""]
    if (OUT / "speed.jsonl").exists():
        sections += ["## Speed: batch-1 decoding of SmolLM2, 64 prompt and 128 new tokens (median step)", "",
                     *speed_table(read_jsonl(OUT / "speed.jsonl")), ""]
    if (OUT / "memory.jsonl").exists():
        sections += ["## Memory: peak of torch's CPU allocations while SmolLM2 loads and generates 64 tokens "
                     "(`ladder.runtime.memory.peak_cpu_bytes`) against `ladder.runtime.memory`'s estimate", "",
                     *memory_table(read_jsonl(OUT / "memory.jsonl")), ""]
    if (OUT / "serve.jsonl").exists():
        sections += ["## The server under the burst load (32 requests, 8 in flight, 64 prompt + 64 output tokens)", "",
                     *serve_table(OUT / "serve.jsonl"), ""]
    if (OUT / "gain.jsonl").exists():
        sections += ["## Ladder's gain, measured: llama-160m, TP 4, emulated pcie-no-p2p dilated once (25 % of the "
                     "unquantized standard step), bf16, compiled layers", "", *gain_table(OUT / "gain.jsonl"), ""]
    sections += ["## Ladder's gain, predicted (cost model): Llama-3-70B, TP 8, H100, prompt 1024, 512 new tokens", "",
                 *predicted_table(predicted_gain()), ""]
    (OUT / "report.md").write_text("\n".join(sections))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="quality,answers,speed,memory,serve,gain")
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python installed (the CPU peer)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    if "quality" in parts:
        write_jsonl(OUT / "quality.jsonl", quality())
    if "answers" in parts:
        write_jsonl(OUT / "answers.jsonl", answers())
    if "speed" in parts:
        write_jsonl(OUT / "speed.jsonl", speed(args.llama_cpp_python))
    if "memory" in parts:
        write_jsonl(OUT / "memory.jsonl", memory())
    if "serve" in parts:
        serve()
    if "gain" in parts:
        gain()
    report()


if __name__ == "__main__":
    main()
