"""Soak and faults: thousands of mixed requests against `ladder serve`, then SIGTERM and a killed rank.

The model is tiny (random weights in the `tiny` preset's shape) with SmolLM2's tokenizer and chat
template, so that every path of the API runs and the server, not the model, is what is measured. At
each TP degree:
- soak: `--requests` requests, `--concurrency` in flight, mixed: completions and chats, streamed or not,
  greedy or sampled (temperature, top-p, top-k, seeds), stop strings, 1..32 new tokens; a tenth of the
  streamed clients disconnect after their first chunk; every 250 requests a burst of 48 at once, above
  `--max-waiting 16` (those over it get 503 with Retry-After, by design). Reported: answers by status
  and cause, streams cut without a finish reason, p99 latencies, and the server's resident memory (every
  rank's process) after the warm-up (the first tenth) and at the end.
- SIGTERM under load: 16 streams in flight, then SIGTERM to the server; every stream must end with a
  finish reason or an error, none may hang, and the server must exit 0.
- a killed rank (TP 2): 16 streams in flight, then SIGKILL to rank 1; every client must get an error
  (or its finish) within the distributed timeout (LADDER_DIST_TIMEOUT=20 s here), and the server must
  exit non-zero.

    .venv/bin/python experiments/soak.py [--requests 3000] [--tps 1,2] [--short]
    .venv/bin/python experiments/soak.py --memory-curve --requests 6000 --tps 1   (docs/serving.md's curves)

Writes results/serve/soak.jsonl and soak.md (`--short`: 200 requests, a burst after 150, TP 1, no files:
what the test suite runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from ladder.bench.serve_load import descendants, free_port, server_followers, wait_until_healthy
from ladder.checkpoint.hf import save_random_hf
from ladder.checkpoint.resolve import open_checkpoint
from ladder.model.config import get_preset

OUT = Path("results/serve")
MODEL_NAME = "soak"
DIST_TIMEOUT_S = 20
SHORT = (200, 12, 150)  # requests, in flight, a burst after: the test suite's run


def write_model(folder: Path) -> Path:
    tokenizer = open_checkpoint("smollm2-135m-instruct").tokenizer
    config = get_preset("tiny", vocab_size=tokenizer.vocab_size, max_seq_len=256)
    return save_random_hf(folder, config, tokenizer, force=True)


class Server:
    """`ladder serve` on a free port, with its processes (the launcher and every rank)."""

    def __init__(self, folder: Path, tp: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The eager step, as in the recorded runs (results/serve/soak.md): the CPU's default would first compile
        # its shapes (39 s more of the short mode on two cores); the scheduler and the HTTP side are the same.
        command = [sys.executable, "-m", "ladder", "serve", "--model", str(folder), "--served-model-name", MODEL_NAME,
                   "--tp", str(tp), "--max-batch", "8", "--max-waiting", "16", "--eager", "--port", str(self.port)]
        env = {**os.environ, "LADDER_DIST_TIMEOUT": str(DIST_TIMEOUT_S)}
        self.log = tempfile.TemporaryFile(mode="w+")  # (a pipe nobody reads would stall the server once full)
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env)
        wait_until_healthy(self.url, [self.proc], 180)

    def stop(self) -> tuple[int, str]:
        """SIGTERM; (exit code, what it said on stderr)."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self.log.seek(0)
        return code, self.log.read()

    def processes(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def resident_bytes(self) -> int:
        return sum(resident_bytes(pid) for pid in self.processes())



def resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (FileNotFoundError, StopIteration):
        return 0


def random_request(rng: random.Random) -> tuple[str, dict, bool]:
    """(path, body, disconnect after the first chunk)."""
    chat = rng.random() < 0.5
    body: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 32), "stream": rng.random() < 0.6}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hello!", "Tell me a story.", "2+2?", "Ünïcödé 🙂"])}]
    else:
        body["prompt"] = rng.choice(["Once upon a time", "def f(x):", "The capital of France is", "🙂 " * 20])
    if rng.random() < 0.5:
        body.update(temperature=rng.choice([0.5, 1.0, 1.5]), top_p=rng.choice([0.8, 1.0]),
                    top_k=rng.choice([-1, 5, 50]), seed=rng.choice([None, rng.randrange(2**31)]))
    else:
        body["temperature"] = 0
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["e", "the", "\n"])]
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, body["stream"] and rng.random() < 0.1


async def one_request(client: httpx.AsyncClient, path: str, body: dict, disconnect: bool) -> dict:
    """Status, cause, whether a stream ended with a finish reason, and latencies."""
    start = time.perf_counter()
    record: dict = {"stream": body["stream"], "disconnected": disconnect}
    try:
        async with client.stream("POST", path, json=body) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                record["cause"] = (json.loads(await response.aread()).get("error") or {}).get("type", "?")
            elif body["stream"]:
                finished = False
                async for line in response.aiter_lines():
                    if "ttft_s" not in record and line.startswith("data: {"):
                        record["ttft_s"] = time.perf_counter() - start
                        if disconnect:
                            break
                    if line.startswith("data: {") and '"finish_reason":"' in line.replace(" ", ""):
                        finished = True
                    if line.startswith("data: {") and '"error"' in line:
                        record["cause"] = "error event"
                record["finished"] = finished or disconnect
            else:
                await response.aread()
                record["ttft_s"] = time.perf_counter() - start
    except httpx.HTTPError as exc:
        record.update(status="connection", cause=type(exc).__name__)
    record["e2e_s"] = time.perf_counter() - start
    return record


async def soak(server: Server, n_requests: int, concurrency: int, seed: int,
               burst_every: int = 250) -> tuple[list[dict], list[tuple[int, int]]]:
    """The answers, and the server's resident memory after each tenth of the requests."""
    rng = random.Random(seed)
    records: list[dict] = []
    rss_curve: list[tuple[int, int]] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        sent, next_burst = 0, burst_every
        while sent < n_requests:
            size = concurrency
            if sent >= next_burst:  # a burst above --max-waiting
                size, next_burst = 48, next_burst + burst_every
            batch = [random_request(rng) for _ in range(min(size, n_requests - sent))]
            records += await asyncio.gather(*(one_request(client, *r) for r in batch))
            sent += len(batch)
            if sent >= (len(rss_curve) + 1) * n_requests // 10:
                rss_curve.append((sent, server.resident_bytes()))
    return records, rss_curve


async def streams_then(server: Server, action, n: int = 16) -> list[dict]:
    """`n` long streams; `action()` once every one has its first chunk; every stream's end."""
    async with httpx.AsyncClient(base_url=server.url, timeout=DIST_TIMEOUT_S + 40) as client:
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
                "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.create_task(one_request(client, "/v1/completions", body, False)) for _ in range(n)]
        await asyncio.sleep(1.0)
        action()
        return list(await asyncio.gather(*tasks))


def summarise(tp: int, records: list[dict], rss_curve: list[tuple[int, int]]) -> dict:
    """Growth is from the first tenth (the warm-up) to the end."""
    warm_rss, end_rss = rss_curve[0][1], rss_curve[-1][1]
    causes = Counter(f"{r['status']} {r.get('cause', '')}".strip() for r in records)
    served = [r for r in records if r["status"] == 200]
    cut = sum(1 for r in served if r["stream"] and not r.get("finished"))
    p99 = lambda key: statistics.quantiles([r[key] for r in served if key in r], n=100)[98] * 1e3  # noqa: E731
    return {"tp": tp, "requests": len(records), "served": len(served), "by_status": dict(causes), "streams_cut": cut,
            "disconnected": sum(r["disconnected"] for r in records), "ttft_p99_ms": p99("ttft_s"),
            "e2e_p99_ms": p99("e2e_s"), "rss_after_warmup_mb": warm_rss / 2**20, "rss_end_mb": end_rss / 2**20,
            "rss_growth": end_rss / warm_rss - 1, "rss_curve_mb": [(n, rss / 2**20) for n, rss in rss_curve]}


def fault_sigterm(folder: Path, tp: int) -> dict:
    server = Server(folder, tp)
    start = time.perf_counter()
    ends = asyncio.run(streams_then(server, lambda: server.proc.send_signal(signal.SIGTERM)))
    code = server.proc.wait(60)
    return {"tp": tp, "fault": "SIGTERM", "streams": len(ends), "finished_or_error": sum(
        1 for r in ends if r.get("finished") or r["status"] != 200), "hung": 0, "exit_code": code,
        "last_end_s": max(r["e2e_s"] for r in ends), "wall_s": time.perf_counter() - start}


def fault_killed_rank(folder: Path) -> dict:
    server = Server(folder, 2)
    victim = server_followers(server.proc.pid, server.port)[0]  # rank 1
    ends = asyncio.run(streams_then(server, lambda: os.kill(victim, signal.SIGKILL)))
    try:
        code = server.proc.wait(DIST_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = "hung"
    return {"tp": 2, "fault": "SIGKILL rank 1", "streams": len(ends), "errors": sum(
        1 for r in ends if r["status"] != 200 or not r.get("finished") or r.get("cause")),
        "last_end_s": max(r["e2e_s"] for r in ends), "exit_code": code}


def soak_once(folder: Path, tp: int, n_requests: int, concurrency: int, burst_every: int = 250) -> dict:
    """One server under the mixed load, then stopped: the summary, its exit code and tracebacks."""
    server = Server(folder, tp)
    try:
        result = summarise(tp, *asyncio.run(soak(server, n_requests, concurrency, tp, burst_every)))
    finally:
        code, said = server.stop()
    return {**result, "exit_code": code, "tracebacks_in_log": said.count("Traceback")}


def run(folder: Path, tps: list[int], n_requests: int, concurrency: int, burst_every: int = 250) -> list[dict]:
    rows = []
    for tp in tps:
        rows.append(soak_once(folder, tp, n_requests, concurrency, burst_every))
        rows.append(fault_sigterm(folder, tp))
        if tp == 2:
            rows.append(fault_killed_rank(folder))
    return rows


def write_summary(rows: list[dict]) -> None:
    soaks = [r for r in rows if "fault" not in r]
    faults = [r for r in rows if "fault" in r]
    lines = ["| TP | requests | served (200) | answers by status and cause | streams cut | disconnected | TTFT p99 (ms) | "
             "E2E p99 (ms) | RSS after warm-up / end (MB) | growth | tracebacks |", "|" + "---|" * 11]
    for r in soaks:
        causes = ", ".join(f"{k}: {v}" for k, v in sorted(r["by_status"].items()))
        lines.append(f"| {r['tp']} | {r['requests']} | {r['served']} | {causes} | {r['streams_cut']} | "
                     f"{r['disconnected']} | {r['ttft_p99_ms']:.0f} | {r['e2e_p99_ms']:.0f} | "
                     f"{r['rss_after_warmup_mb']:.0f} / {r['rss_end_mb']:.0f} | {r['rss_growth']:+.1%} | "
                     f"{r['tracebacks_in_log']} |")
    lines += ["", "| TP | fault | streams | ended with a finish reason or an error | last stream ended (s) | exit code |",
              "|---|---|---|---|---|---|"]
    for r in faults:
        ended = r.get("finished_or_error", r.get("errors"))
        lines.append(f"| {r['tp']} | {r['fault']} | {r['streams']} | {ended} | {r['last_end_s']:.1f} | {r['exit_code']} |")
    lines += ["", "Written by experiments/soak.py (tiny random model, SmolLM2's tokenizer; LADDER_DIST_TIMEOUT=20)."]
    (OUT / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--tps", default="1,2")
    parser.add_argument("--short", action="store_true", help="200 requests at TP 1, nothing written")
    parser.add_argument("--memory-curve", action="store_true",
                        help="the soak alone at each of --tps, no faults: its summary with the resident-memory "
                             "curve (after each tenth of the requests) printed, nothing written")
    args = parser.parse_args()
    folder = write_model(Path("runs/soak-model"))
    if args.memory_curve:
        for tp in (int(t) for t in args.tps.split(",")):
            print(json.dumps(soak_once(folder, tp, args.requests, args.concurrency)))
        return
    if args.short:
        rows = run(folder, [1], *SHORT)
        print(json.dumps(rows, indent=1))
        return
    rows = run(folder, [int(t) for t in args.tps.split(",")], args.requests, args.concurrency)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "soak.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_summary(rows)


if __name__ == "__main__":
    main()
