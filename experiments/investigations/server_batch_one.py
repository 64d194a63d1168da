"""The server at batch 1 against `ladder generate`, in turns: how much HTTP streaming costs a token.

This 2-core machine's speed drifts by 10-20 % over minutes, more than the gap asked about (5 %), so the
two take turns: one `Engine.generate` in this process (what `ladder generate` runs, SmolLM2 fp32, 64
prompt and 128 new tokens), then the same prompt streamed from `ladder serve --model smollm2-135m-instruct
--max-batch 8 --max-model-len 512` (the README's flags), and again, `--rounds` times. Each turn's mean
inter-token time; the ratio of each pair, and its median. The client reads the stream as vLLM's
benchmark does (raw server-sent events, here with httpx), and, in its own turns, with the official
`openai` client, whose parsing costs more CPU on the cores the step uses. The two are never
measured at once, so neither's threads slow the other.

    .venv/bin/python experiments/investigations/server_batch_one.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import openai
import torch

from ladder.bench.serve_load import StartedServer, free_port
from ladder.comm.base import LocalCommunicator
from ladder.model.spec import ModelSpec
from ladder.runtime.engine import Engine

MODEL = "smollm2-135m-instruct"
PROMPT = list(range(1000, 1064))
NEW_TOKENS = 128


def mean_gap_ms(stamps: list[float]) -> float:
    return statistics.mean(b - a for a, b in zip(stamps, stamps[1:])) * 1e3


async def streamed_raw(url: str) -> list[float]:
    """When each token's text arrived, from the raw event stream."""
    stamps = []
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "stream": True, "temperature": 0,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client, client.stream("POST", url + "/v1/completions",
                                                                        json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return stamps


async def streamed_openai(url: str) -> list[float]:
    """The same, through the official client."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stamps = []
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW_TOKENS, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            stamps.append(time.perf_counter())
    await client.close()
    return stamps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    engine = Engine(ModelSpec(model=MODEL, dtype="float32").load(LocalCommunicator(), torch.device("cpu")).model)
    prompt = torch.tensor([PROMPT])
    engine.generate(prompt, 8)  # warm-up
    clients = {"raw": streamed_raw, "openai": streamed_openai}
    ratios: dict[str, list[float]] = {name: [] for name in clients}
    port = free_port()
    with StartedServer.ladder(f"--model {MODEL} --max-batch 8 --max-model-len 512 --eager", port) as server:
        for name in clients:
            asyncio.run(clients[name](server.url))  # warm-up
        for round_ in range(args.rounds):
            for name, stream in clients.items():
                alone = statistics.mean(engine.generate(prompt, NEW_TOKENS).token_latencies_s) * 1e3
                served = mean_gap_ms(asyncio.run(stream(server.url)))
                ratios[name].append(served / alone)
                print(f"round {round_ + 1}, {name} client: generate {alone:.2f} ms a token, server {served:.2f} ms "
                      f"(x{served / alone:.3f})", flush=True)
    for name, values in ratios.items():
        print(f"{name} client: server / generate, median of {len(values)}: x{statistics.median(values):.3f} "
              f"(range {min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
