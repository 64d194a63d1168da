"""`ladder bench serve`: a load generator for OpenAI-compatible servers, in the manner of vLLM's serving
benchmark: requests arrive at a Poisson rate (or all at once), stream their answers, and each one's time
to first token, inter-token latencies and end-to-end latency are measured on the client.

It drives any server that speaks the OpenAI API (ladder's own, llama.cpp's, vLLM's) through the official
`openai` client, or starts `ladder serve` itself (`--serve "ARGS"`). Prompts and output lengths come from
the Shakespeare plays (a speech as the prompt, the next speech's length as the output length) or are
fixed. A server without a tokenizer (random weights) gets its prompts as byte ids, which every
vocabulary holds.
"""

from __future__ import annotations

import asyncio
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ladder.bench.summary import percentiles
from ladder.checkpoint.resolve import open_checkpoint
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.corpora import shakespeare_text
from ladder.errors import LadderError


@dataclass(frozen=True)
class LoadSpec:
    num_requests: int = 32
    request_rate: float = float("inf")  # requests per second (Poisson); inf: all at once
    max_concurrency: int | None = None
    dataset: str = "shakespeare"  # or "fixed"
    prompt_len: int = 64  # fixed: every prompt; shakespeare: the most a speech is cut to
    output_len: int = 64  # fixed: every output; shakespeare: the most
    byte_prompts: bool = False  # prompts as byte ids (a server without tokenizer)
    ignore_eos: bool = True  # outputs of exactly the drawn length (vLLM's extension; llama.cpp's too)
    seed: int = 0
    tokenizer: str = "smollm2-135m-instruct"  # measures the lengths of text prompts and outputs


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None
    text: str = ""
    counted_by_server: bool = False  # usage came in the stream (stream_options.include_usage)


@dataclass(frozen=True)
class LoadRequest:
    prompt: str | list[int]
    prompt_tokens: int
    output_len: int


def load_tokenizer(spec: LoadSpec) -> TextTokenizer | None:
    """The tokenizer that measures prompts and outputs (None for byte prompts: a server without one)."""
    return None if spec.byte_prompts else open_checkpoint(spec.tokenizer).tokenizer


def draw_requests(spec: LoadSpec, tokenizer: TextTokenizer | None) -> list[LoadRequest]:
    rng = random.Random(spec.seed)
    to_ids = tokenizer.encode if tokenizer is not None else (lambda text: list(text.encode()))
    speeches = [s.strip() for s in shakespeare_text("heldout").split("\n\n") if len(s.strip()) > 40]
    requests = []
    for _ in range(spec.num_requests):
        i = rng.randrange(len(speeches) - 1)
        ids = to_ids(speeches[i] if spec.dataset == "shakespeare" else " ".join(speeches[i:i + 40]))
        prompt = ids[:spec.prompt_len]
        out = spec.output_len if spec.dataset == "fixed" else max(4, min(spec.output_len, len(to_ids(speeches[i + 1]))))
        if spec.dataset == "fixed" and len(prompt) < spec.prompt_len:
            raise LadderError(f"no passage of {spec.prompt_len} tokens to cut a prompt from")
        requests.append(LoadRequest(prompt if tokenizer is None else tokenizer.decode(prompt), len(prompt), out))
    return requests


async def _one(client: Any, model: str, request: LoadRequest, spec: LoadSpec) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(prompt_tokens=request.prompt_tokens, output_tokens=0)
    last = start
    try:
        stream = await client.completions.create(
            model=model, prompt=request.prompt, max_tokens=request.output_len, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": spec.ignore_eos})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.text += chunk.choices[0].text
                result.output_tokens += 1  # (a chunk a token, until the server's usage says otherwise)
            if chunk.usage is not None:
                result.prompt_tokens, result.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                result.counted_by_server = True
        result.e2e_s = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, not the end of the run)
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(url: str, spec: LoadSpec, model: str | None = None) -> dict[str, Any]:
    """Send the requests to the server at `url`; the run's summary (latencies in ms).

    A server that sends no usage in the stream (llama-cpp-python ignores `stream_options`) has its
    output counted on the client, as vLLM's benchmark does: the answer's text re-tokenised, or one token
    a chunk for byte prompts."""
    try:
        import openai  # (an optional dependency: only this command needs it)
    except ImportError:
        raise LadderError("ladder bench serve needs the openai client: pip install openai") from None
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=600)
    model = model or (await client.models.list()).data[0].id
    tokenizer = load_tokenizer(spec)
    requests = draw_requests(spec, tokenizer)
    rng = random.Random(spec.seed + 1)
    limit = asyncio.Semaphore(spec.max_concurrency or len(requests))

    async def limited(request: LoadRequest) -> RequestResult:
        async with limit:
            return await _one(client, model, request, spec)

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(limited(request)))
        if spec.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(spec.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    await client.close()
    for r in results:
        if not r.counted_by_server and tokenizer is not None:
            r.output_tokens = len(tokenizer.encode(r.text))
    return summarise(results, duration) | {"model": model, "url": url, "load": asdict(spec)}


def summarise(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    itl = [x for r in ok for x in r.itl_s]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
           "request_throughput": len(ok) / duration_s, "output_throughput": sum(r.output_tokens for r in ok) / duration_s,
           "total_output_tokens": sum(r.output_tokens for r in ok), "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
           "errors": sorted({r.error for r in results if r.error})[:3],
           "usage_from": "server" if all(r.counted_by_server for r in ok) else "client"}
    for name, values in (("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]), ("itl", itl),
                         ("e2e", [r.e2e_s for r in ok])):
        out[f"{name}_ms"] = percentiles([v * 1e3 for v in values])
    return out


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, processes: list[subprocess.Popen], timeout_s: float) -> None:
    """Until `url`/health says 200; a `LadderError` as soon as one of the server's processes has exited,
    or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ended := [p for p in processes if p.poll() is not None]:
            raise LadderError(f"the server exited {ended[0].returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:  # refused while starting, or 503 (HTTPError) while loading
            pass
        time.sleep(0.2)
    raise LadderError(f"the server was not healthy after {timeout_s:.0f} s")


def server_followers(launcher_pid: int, port: int) -> list[int]:
    """The processes of a `ladder serve` launcher's ranks other than 0: its workers are the children of
    its fork server (itself a child of the launcher), and rank 0 is the one that holds the listening
    socket (found in /proc/net/tcp)."""
    listening = next(line.split()[9] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                     if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A")
    workers = [pid for child in _children(launcher_pid) for pid in _children(child)]
    return [pid for pid in workers
            if f"socket:[{listening}]" not in {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}]


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (TP workers are forked by a fork server: grandchildren)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except FileNotFoundError:  # ended meanwhile
        return []
    return children + [d for c in children for d in descendants(c)]


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{pid}\n" in status.read_text():
                found.append(int(status.parent.name))
        except OSError:
            continue
    return found


class StartedServer:
    """A server process for the length of a `with` block, ready once its /health says 200: `ladder serve`
    (`StartedServer.ladder`) or any other OpenAI-compatible server's `command` listening on `port`."""

    def __init__(self, command: list[str], port: int, name: str, startup_s: float = 600) -> None:
        self.command, self.name, self.startup_s = command, name, startup_s
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    def ladder(cls, args: str, port: int) -> StartedServer:
        """`ladder serve ARGS --port PORT`."""
        return cls([sys.executable, "-m", "ladder", "serve", *shlex.split(args), "--port", str(port)], port,
                   f"ladder serve {args}")

    def __enter__(self) -> StartedServer:
        self.log = tempfile.TemporaryFile(mode="w+")  # (a pipe nobody reads would stall a talkative server)
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        try:
            wait_until_healthy(self.url, [self.proc], self.startup_s)
        except LadderError as exc:
            self.log.seek(0)
            said = self.log.read().strip()
            self.__exit__()
            raise LadderError(f"{self.name}: {exc}: {said}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
