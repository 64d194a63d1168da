"""Ladder inside vLLM: standard, ladder and the upper bound on the emulated link, served by vLLM with ladder's
plugin and by `ladder serve`, under one load from `ladder bench serve`.

The model is llama-160m's shape (random weights) with SmolLM2's vocabulary and tokenizer, so that both
servers take text. The link is pcie-no-p2p at TP 4, dilated x7.69 as experiments/serving.py dilates it (the
main job's batch-4 share: communication a quarter of standard's step): one process computes rank 0's exact
shard, and each all-reduce is a wait of the modelled duration. In vLLM that is
`--additional-config '{"ladder": {"interconnect": ..., "tp": 4, "link_scale": ...}}'`; its standard folder
goes through the plugin too (`--hf-overrides`), so that standard's all-reduces are the same emulated link's.
vLLM runs eager (`--enforce-eager`), or compiled by vLLM's inductor path with `--vllm-compiled`.

    .venv/bin/python experiments/vllm_serving.py [--rounds 2] [--rates inf]
    .venv/bin/python experiments/vllm_serving.py --servers vllm --link-scale 23 --out results/vllm/own-step
    (vLLM alone, its link dilated to about a quarter of its own standard step)
    .venv/bin/python experiments/vllm_serving.py --servers vllm --vllm-compiled --link-scale 23 --out results/vllm/compiled

Load: 32 requests, 8 in flight, 64 prompt and 64 output tokens (ignore_eos), servers in turns, `--rounds`
times. Writes results/vllm/{bench-serve.jsonl,summary.md}.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from ladder.bench.serve_load import StartedServer, free_port
from ladder.checkpoint.hf import save_random_hf
from ladder.comm.base import LocalCommunicator
from ladder.model.config import get_preset
from ladder.model.spec import ModelSpec

OUT = Path("results/vllm")  # (--out)
FOLDERS = Path("runs/vllm-folders")  # git-ignored
LAYOUTS = ("standard", "ladder", "upper-bound")
LINK, TP, SLOTS, CONTEXT = "pcie-no-p2p", 4, 8, 512


def make_folders(link_scale: float) -> dict[str, Path]:
    tokenizer = ModelSpec(model="smollm2-135m-instruct").load(LocalCommunicator(), torch.device("cpu")).tokenizer
    folders = {}
    for layout in LAYOUTS:
        config = get_preset("llama-160m", layout=layout, vocab_size=tokenizer.vocab_size)
        folders[layout] = save_random_hf(FOLDERS / layout, config, tokenizer, force=True)
    return folders


def vllm_command(folder: Path, layout: str, port: int, link_scale: float, compiled: bool) -> list[str]:
    ladder = {"ladder": {"interconnect": LINK, "tp": TP, "link_scale": link_scale}}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port", str(port),
               "--served-model-name", layout, "--dtype", "float32", "--max-model-len", str(CONTEXT),
               "--max-num-seqs", str(SLOTS), "--gpu-memory-utilization", "0.2",
               "--additional-config", json.dumps(ladder)] + ([] if compiled else ["--enforce-eager"])
    if layout == "standard":  # a plain Llama folder: through the plugin, for the emulated link
        command += ["--hf-overrides", json.dumps({"architectures": ["LadderLlamaForCausalLM"]})]
    return command


def ladder_serve_args(folder: Path, link_scale: float) -> str:
    return (f"--model {folder} --tp {TP} --interconnect {LINK} --link-scale {link_scale} --max-batch {SLOTS} "
            f"--max-model-len {CONTEXT}")


def measure(label: str, server: StartedServer, args: argparse.Namespace, round_: int) -> None:
    with server:
        result = subprocess.run([sys.executable, "-m", "ladder", "bench", "serve", "--url", server.url, "--label", label,
                                 "--request-rates", args.rates, "--num-requests", str(args.num_requests),
                                 "--dataset", "fixed", "--prompt-len", "64", "--output-len", "64",
                                 "--max-concurrency", str(SLOTS), "--seed", str(round_),
                                 "--out", str(args.out / "bench-serve.jsonl")], text=True)
        if result.returncode != 0:
            raise SystemExit(f"bench serve against {label} failed")


def summary(out: Path, link_scale: float) -> None:
    rows = [json.loads(line) for line in (out / "bench-serve.jsonl").read_text().splitlines()]
    runs: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        runs.setdefault((r["label"], r["request_rate"]), []).append(r)
    med = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731 (the median over rounds)
    itl = {key: med(rs, lambda r: r["itl_ms"]["mean"]) for key, rs in runs.items()}
    lines = ["| server | layout | rate (req/s) | output tok/s | ITL mean (ms) | ITL p99 | TTFT p50 (ms) | "
             "ITL vs standard | hidden (ITL) |", "|---|---|---|---|---|---|---|---|---|"]
    for (label, rate), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        server, layout = label.split(": ")
        standard, bound = itl.get((f"{server}: standard", rate)), itl.get((f"{server}: upper-bound", rate))
        hidden = ""
        if layout == "ladder" and standard and bound and standard > bound:
            hidden = f"{(standard - itl[(label, rate)]) / (standard - bound):.2f}"
        lines.append(f"| {server} | {layout} | {rate:g} | {med(rs, lambda r: r['output_throughput']):.1f} | "
                     f"{itl[(label, rate)]:.1f} | {med(rs, lambda r: r['itl_ms']['p99']):.1f} | "
                     f"{med(rs, lambda r: r['ttft_ms']['p50']):.0f} | {standard / itl[(label, rate)]:.3f}x | {hidden} |")
    lines += ["", f"Medians of {len(next(iter(runs.values())))} rounds; {rows[0]['load']['num_requests']} requests a "
              f"run, at most {SLOTS} in flight, 64 prompt and 64 output tokens; llama-160m shape at TP {TP} on the "
              f"emulated {LINK} link dilated x{link_scale:g}; `ITL vs standard`: standard's mean inter-token latency / this one's; "
              "`hidden`: (standard - ladder) / (standard - upper bound), by ITL. Written by experiments/vllm_serving.py."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rates", default="inf")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--link-scale", type=float, default=7.69)
    parser.add_argument("--servers", default="vllm,ladder", help="which servers to measure (vllm, ladder)")
    parser.add_argument("--vllm-compiled", action="store_true", help="let vLLM compile the model (default: eager)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    servers = args.servers.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-serve.jsonl").unlink(missing_ok=True)
    folders = make_folders(args.link_scale)
    for round_ in range(args.rounds):
        for layout in LAYOUTS:
            if "vllm" in servers:
                port = free_port()
                label = f"vllm{' compiled' if args.vllm_compiled else ''} + ladder plugin: {layout}"
                command = vllm_command(folders[layout], layout, port, args.link_scale, args.vllm_compiled)
                measure(label, StartedServer(command, port, label), args, round_)
            if "ladder" in servers:
                port = free_port()
                measure(f"ladder serve: {layout}",
                        StartedServer.ladder(ladder_serve_args(folders[layout], args.link_scale), port), args, round_)
    summary(args.out, args.link_scale)
    shutil.rmtree(FOLDERS, ignore_errors=True)


if __name__ == "__main__":
    main()
