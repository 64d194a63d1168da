"""One rank's process of `ladder serve`.

Global rank 0 owns the HTTP server (uvicorn, in the main thread, which takes SIGTERM and Ctrl-C) and
the scheduler (an engine thread); every other rank loads its shard and runs the plans rank 0 sends,
until rank 0 sends a stop. On an emulated link there is one process, rank 0's exact shard, whose
all-reduces are waits of the link's modelled duration (as in `ladder bench`).

Shutdown: SIGTERM or Ctrl-C stops new connections; requests in flight finish within
`shutdown_timeout_s`, then what is left is aborted, the other ranks are stopped, and the process exits
0. A failed rank fails the engine's next collective (or its timeout, LADDER_DIST_TIMEOUT): the server
then answers 503 and exits non-zero.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import torch
import uvicorn

from ladder.comm.base import Communicator
from ladder.comm.distributed import (DistContext, check_ranks_agree, from_every_rank, init_distributed, pick_device,
                                     shutdown_distributed)
from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.links import get_link
from ladder.console import say
from ladder.errors import LadderError
from ladder.model.config import cpu_computes_in_bf16
from ladder.model.spec import ModelSpec
from ladder.model.transformer import HALF_PRECISION
from ladder.options import DecodeStep, RuntimeOptions
from ladder.runtime.engine import Engine
from ladder.runtime.limits import check_max_model_len
from ladder.runtime.memory import KvCachePlan, memory_available_now, parse_memory_setting, plan_kv_cache
from ladder.serve.api import ServerState, create_app
from ladder.serve.metrics import ServerMetrics
from ladder.serve.scheduler import Scheduler
from ladder.serve.steps import run_plan, share_plan


ABORTED_STREAMS_END_S = 5  # after the drain: for aborted streams to send their last event


@dataclass(frozen=True)
class ServeSettings:
    model: ModelSpec
    name: str  # the model's name in the API
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_model_len: int | None = None  # default: what fits the KV-cache budget, up to the model's max_seq_len
    max_waiting: int = 256
    max_num_batched_tokens: int = 2048  # one token per running request, the rest prompt chunks (vLLM's CPU default)
    shutdown_timeout_s: float = 10.0
    interconnect: str | None = None  # an emulated link: one process, rank 0's shard
    link_scale: float = 1.0
    decode_step: DecodeStep = DecodeStep.EAGER  # compiled or CUDA-graphed: fixed shapes, made at start-up
    kv_cache_memory: str = "0.15"  # the KV cache's budget: a fraction of the memory available, or a size
    api_key: str | None = field(default=None, repr=False)  # required on /v1/* when set; never printed
    max_prefill_while_decoding: int = 0  # prompt tokens a step carries while requests decode (0: the budget's rest)


def serve_on_rank(settings: ServeSettings) -> None:
    ctx = None if settings.interconnect else init_distributed(settings.model.device)
    try:
        if ctx is not None:
            check_ranks_agree(settings, "serve options")
        if ctx is not None and ctx.rank != 0:
            _follow(settings, ctx)
        else:
            _serve(settings, ctx)
    finally:
        if ctx is not None:
            shutdown_distributed()
    if ctx is not None and ctx.world_size > 1:
        # Shut down cleanly after a signal. torch's launcher (ours and torchrun), stopping on that signal,
        # would wait 30 s for a worker that returns (a returning worker waits for the launcher to collect
        # its result): end the process here instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _communicator(settings: ServeSettings, ctx: DistContext | None) -> tuple[Communicator, torch.device]:
    if ctx is not None:
        return ctx.communicator(), ctx.device
    device = pick_device(settings.model.device)
    return EmulatedCommunicator(get_link(settings.interconnect), settings.model.tp, device, settings.link_scale), device


def _load_engine(settings: ServeSettings, ctx: DistContext | None) -> tuple[Engine, object]:
    comm, device = _communicator(settings, ctx)
    plan = _kv_cache_plan(settings, ctx, device)  # (before the weights: a context that cannot fit stops here)
    say(f"ladder: {plan.describe()}")
    loaded = settings.model.load(comm, device, exact=ctx is not None or settings.model.model is not None)
    engine = Engine(loaded.model, serving_options(settings.decode_step))
    loaded.model = engine.model  # the engine's view: the weights it packed replace the model's
    engine.reserve(plan.rows, plan.max_model_len, padded=True)
    return engine, loaded


def serving_options(step: DecodeStep) -> RuntimeOptions:
    """The environment's options, with inductor's GEMM templates only where the user turns them on
    (`LADDER_CPU_GEMM_TEMPLATES=1`): a server compiles a step for each of its shapes (32 by default), and
    each shape's templates pack a copy of the weights of their own (SmolLM2 int8: 183-325 MiB more
    resident for a second shape, over three runs), where `ladder generate` compiles one."""
    options = RuntimeOptions.from_environment(step)
    return options if options.cpu_gemm_templates is not None else replace(options, cpu_gemm_templates=False)


def _kv_cache_plan(settings: ServeSettings, ctx: DistContext | None, device: torch.device) -> KvCachePlan:
    """Rank 0's plan for every rank (they must agree on rows and context); its refusal on every rank.
    A fraction of the memory available is shared by the ranks on this machine."""
    decision: KvCachePlan | str
    try:
        config = settings.model.config()
        if settings.max_model_len:
            check_max_model_len(settings.max_model_len, config.max_seq_len)
        setting = parse_memory_setting(settings.kv_cache_memory)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        budget = setting if isinstance(setting, int) else int(setting * memory_available_now(device) / local_ranks)
        decision = plan_kv_cache(config, settings.model.tp, settings.model.torch_dtype(device).itemsize, budget,
                                 settings.max_batch, settings.max_model_len)
    except LadderError as exc:
        decision = str(exc)
    if ctx is not None:
        decision = from_every_rank(decision)[0]
    if isinstance(decision, str):
        raise LadderError(decision)
    return decision


PROGRESS_EVERY_S = 5.0  # between two of the warm-up's progress lines


def _warm_up(engine: Engine) -> None:
    """Compile or capture every shape of a compiled or graphed decode step. Every rank calls this at the
    same point, before its first plan: the warm-up's forwards all-reduce."""
    if not engine.shapes:
        return
    kept = "torch's cache keeps them for the next start; " if engine.device.type == "cpu" else ""
    say(f"ladder: making the {engine.step.value} decode step for {len(engine.shapes)} shapes (batch "
        f"{'/'.join(map(str, engine.batch_sizes))} x cache {'/'.join(map(str, engine.kv_lens))}; {kept}"
        "--eager serves without)")
    start = last_said = time.perf_counter()

    def progress(done: int, of: int) -> None:  # a line every few seconds: loaded from the cache, 16 come in 5 s
        nonlocal last_said
        if done < of and time.perf_counter() - last_said >= PROGRESS_EVERY_S:
            last_said = time.perf_counter()
            say(f"ladder: {done} of {of} shapes made, {last_said - start:.0f} s")
    engine.warm_up(progress)
    say(f"ladder: decode step ready in {time.perf_counter() - start:.1f} s")


def faster_step_hint(engine: Engine) -> str:
    """What the serving line adds where an eager step serves and a compiled one is measurably faster: on
    CUDA, and in half precision on a CPU with bf16 arithmetic (SmolLM2 bf16 under a burst on AVX-512 BF16:
    212.6 tokens/s with --compile, 186.5 with --compile-layers, 138.1 eager; docs/serving.md). On AVX2 in
    fp32 a compiled step bought nothing at batch 1, so nothing is said there."""
    if engine.step is not DecodeStep.EAGER:
        return ""
    half = engine.model.tok_embeddings.weight.dtype in HALF_PRECISION
    half_on_bf16_cpu = engine.device.type == "cpu" and half and cpu_computes_in_bf16()
    if engine.device.type != "cuda" and not half_on_bf16_cpu:
        return ""
    return "; --compile-layers or --compile decode faster, after a one-time compile of every shape"


def _follow(settings: ServeSettings, ctx: DistContext) -> None:
    """A rank other than 0: run every plan until rank 0 says stop (signals are rank 0's to act on)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    engine, _ = _load_engine(settings, ctx)
    _warm_up(engine)
    while not (plan := share_plan(None, None, ctx.world_size)).stop:
        run_plan(engine, plan)


def _serve(settings: ServeSettings, ctx: DistContext | None) -> None:
    state = ServerState(settings.name, settings.max_model_len or 0, ServerMetrics(settings.name),
                        api_key=settings.api_key)
    config = uvicorn.Config(create_app(state), host=settings.host, port=settings.port, log_level="warning",
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s + ABORTED_STREAMS_END_S))
    server = DrainingServer(config, state, settings.shutdown_timeout_s)
    failure: list[str] = []
    engine = threading.Thread(target=_engine, args=(settings, ctx, state, server, failure), daemon=True,
                              name="ladder-engine")
    engine.start()
    # uvicorn re-raises the signal that stopped it, once shut down, under the handlers it found: ignored,
    # so that the engine and the other ranks stop before this process exits (0).
    found = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()  # until SIGTERM, Ctrl-C, or the engine fails
    finally:
        for s, handler in found.items():
            signal.signal(s, handler)
    if state.scheduler is not None:
        state.scheduler.shutdown()
    engine.join(timeout=60)
    if failure:
        raise LadderError(failure[0])
    say("ladder: server stopped")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown gives the requests in flight `drain_s` seconds and then
    aborts the rest in the scheduler: each ends as an answer does (finish reason "abort"). uvicorn's own
    timeout, later, would cancel the handlers instead: streams cut without an end, a traceback for each."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_s = state, drain_s

    async def shutdown(self, sockets=None) -> None:
        abort = asyncio.get_running_loop().call_later(self.drain_s, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    def _abort_in_flight(self) -> None:
        if self.state.scheduler is not None:
            self.state.scheduler.shutdown()


def _engine(settings: ServeSettings, ctx: DistContext | None, state: ServerState, server: uvicorn.Server,
            failure: list[str]) -> None:
    """Load the model (the HTTP server answers 503 meanwhile), then run the scheduler until shutdown."""
    try:
        engine, loaded = _load_engine(settings, ctx)
        say(f"ladder: {settings.model.describe(loaded)}")
        _warm_up(engine)  # /health says 503 until it is done
        world = ctx.world_size if ctx is not None else 1
        state.max_model_len, state.vocab_size = engine.max_seq, loaded.model.config.vocab_size
        state.tokenizer = loaded.tokenizer
        state.metrics.kv_cache_bytes.set(engine.cache_bytes)
        state.scheduler = Scheduler(engine, loaded.tokenizer, state.metrics, settings.max_waiting,
                                    settings.max_num_batched_tokens, None, world, settings.max_prefill_while_decoding)
        say(f"ladder: serving {settings.name!r} on http://{settings.host}:{settings.port} (max batch "
            f"{engine.max_batch}, context {engine.max_seq}){faster_step_hint(engine)}")
        state.scheduler.run()
    except BaseException as exc:  # noqa: BLE001 (the HTTP server must stop too, and the error reach the CLI)
        message = str(exc).strip()
        failure.append(message.splitlines()[-1] if message else type(exc).__name__)
        server.should_exit = True
