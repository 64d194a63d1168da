"""Rank 0's scheduler: continuous batching with chunked prefill.

Requests join the running batch at step boundaries and leave it when done, each at its own position
with its own sampling parameters and stop conditions. One step is one decode forward over every
running request and at most one chunk (`prefill_chunk` tokens) of one waiting prompt, so a new prompt
delays the running requests by one chunk's forward at most, however long it is. A finished, cancelled
or disconnected request gives its KV-cache row back at once (`steps` keeps the running rows first).

The HTTP side (`ladder.serve.api`) calls `submit` and `cancel` from its thread; `run` is the engine
thread's loop. Outputs go back through each request's `emit` callback, called on the engine thread.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.distributed import communication_failure
from ladder.engine import SamplingParams, sample
from ladder.errors import LadderError
from ladder.serve.metrics import ServerMetrics
from ladder.serve.steps import PrefillChunk, StepPlan, StepRunner, share_plan

HEARTBEAT_S = 1.0  # an idle server still sends empty plans: the other ranks' wait must not time out


class QueueFull(Exception):
    """The waiting queue is at its bound: the client should retry later (HTTP 503 with Retry-After)."""


class Unavailable(Exception):
    """The engine failed (a rank died) or is shutting down: no new requests."""


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()  # stop strings: never part of the output
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass
class Output:
    """New output of one request, in order. `text` is what is new since the previous Output."""
    text: str
    finish_reason: str | None  # None while running; "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: GenerationParams
    emit: Callable[[Output], None]
    generator: torch.Generator
    arrival: float = field(default_factory=time.perf_counter)
    row: int = -1
    prefilled: int = 0  # prompt tokens in the KV cache
    generated: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the output text sent so far
    cancelled: bool = False
    finished: bool = False
    last_token_at: float = 0.0

    @property
    def cached(self) -> int:
        """Positions written in this request's KV-cache row (the newest token is not yet)."""
        return self.prefilled + max(len(self.generated) - 1, 0)


class Scheduler:
    def __init__(self, runner: StepRunner, tokenizer: TextTokenizer | None, metrics: ServerMetrics, max_batch: int,
                 max_waiting: int, prefill_chunk: int, group: dist.ProcessGroup | None = None,
                 world_size: int = 1) -> None:
        self.runner, self.tokenizer, self.metrics = runner, tokenizer, metrics
        self.max_batch, self.max_waiting, self.prefill_chunk = max_batch, max_waiting, prefill_chunk
        self.group, self.world_size = group, world_size
        self.eos_ids = frozenset(tokenizer.stop_ids) if tokenizer is not None else frozenset()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] holds KV-cache row i
        self.prefilling: Sequence | None = None  # holds row len(running)
        self.moves: list[tuple[int, int, int]] = []  # row moves the next plan carries
        self.failure: str | None = None
        self.stopping = False
        self._ids = itertools.count()
        self._lock = threading.Condition()

    # ---- the HTTP side ----------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: GenerationParams, emit: Callable[[Output], None]) -> Sequence:
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        generator = torch.Generator(self.runner.device).manual_seed(seed)
        sequence = Sequence(next(self._ids), prompt, params, emit, generator)
        with self._lock:
            if self.failure is not None or self.stopping:
                raise Unavailable(self.failure or "the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (--max-waiting)")
            self.waiting.append(sequence)
            self.metrics.waiting.set(len(self.waiting))
            self._lock.notify()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """The client went away: free the request's row at the next step boundary."""
        with self._lock:
            sequence.cancelled = True
            self._lock.notify()

    def shutdown(self) -> None:
        """Abort what is still running and let `run` send the other ranks their stop."""
        with self._lock:
            self.stopping = True
            self._lock.notify()

    # ---- the engine thread ------------------------------------------------------------------------

    def run(self) -> None:
        """Plan, share, run and advance steps until `shutdown`; then stop the other ranks. A failure (a
        rank died, say) fails every request in one line and stops serving."""
        try:
            while (plan := self._next_plan()) is not None:
                plan = share_plan(plan, self.group, self.world_size)
                decoded, prefilled = self.runner.run(plan)
                with self._lock:
                    self._advance(plan, decoded, prefilled)
            share_plan(StepPlan(stop=True), self.group, self.world_size)
        except Exception as exc:  # noqa: BLE001 (every failure ends serving; its message goes to each client)
            said = communication_failure(exc) or (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            self._fail(f"the engine failed: {said}")
            raise LadderError(said) from None

    def _next_plan(self) -> StepPlan | None:
        """The next step's plan, waiting for work (sending heartbeats meanwhile); None once stopping."""
        with self._lock:
            while True:
                self._drop_cancelled()
                if self.stopping:
                    self._abort_all()
                    return None
                self._admit()
                self.metrics.running.set(len(self.running) + (self.prefilling is not None))
                self.metrics.waiting.set(len(self.waiting))
                if self.running or self.prefilling is not None:
                    return self._plan()
                if self.moves:
                    return self._plan()  # no compute: the rows to move
                if not self._lock.wait(HEARTBEAT_S) and self.world_size > 1:
                    return self._plan()  # idle for a second: a heartbeat for the other ranks

    def _admit(self) -> None:
        if self.prefilling is None and self.waiting and len(self.running) < self.max_batch:
            self.prefilling = self.waiting.popleft()
            self.prefilling.row = len(self.running)

    def _plan(self) -> StepPlan:
        plan = StepPlan(moves=self.moves)
        self.moves = []
        for s in self.running:
            plan.decode_tokens.append(s.generated[-1])
            plan.decode_positions.append(s.cached)
        if (s := self.prefilling) is not None:
            chunk = s.prompt[s.prefilled:s.prefilled + self.prefill_chunk]
            plan.prefill = PrefillChunk(s.row, chunk, s.prefilled)
        return plan

    def _advance(self, plan: StepPlan, decoded: torch.Tensor | None, prefilled: torch.Tensor | None) -> None:
        now = time.perf_counter()
        for i, s in enumerate(self.running[:len(plan.decode_tokens)]):
            assert decoded is not None
            self._accept(s, self._sample(s, decoded[i]), now)
        if plan.prefill is not None and (s := self.prefilling) is not None:
            s.prefilled += len(plan.prefill.tokens)
            if s.prefilled == len(s.prompt):  # the whole prompt is in: its first token
                assert prefilled is not None
                self.prefilling = None
                self.running.append(s)  # its row is len(running) already
                self.metrics.time_to_first_token.observe(now - s.arrival)
                self._accept(s, self._sample(s, prefilled), now)
        for s in [s for s in self.running if s.finished]:
            self._release(s)

    def _sample(self, s: Sequence, logits: torch.Tensor) -> int:
        return int(sample(logits[None], s.params.sampling, s.generator)[0])

    def _accept(self, s: Sequence, token: int, now: float) -> None:
        """Append a sampled token; send the new text; finish on a stop token, a stop string, max_tokens
        or a full context."""
        if s.generated:
            self.metrics.inter_token_latency.observe(now - s.last_token_at)
        s.last_token_at = now
        s.generated.append(token)
        self.metrics.generation_tokens.inc()
        stops = s.params.stop_token_ids | (frozenset() if s.params.ignore_eos else self.eos_ids)
        if token in stops:
            text = self._text(s.generated[:-1])
            self._finish(s, "stop", text, len(text))
            return
        text = self._text(s.generated)
        hit = min((i for i in (text.find(stop, max(0, s.emitted - len(stop))) for stop in s.params.stop) if i >= 0),
                  default=-1)
        if hit >= 0:
            self._finish(s, "stop", text, hit)
        elif len(s.generated) >= s.params.max_tokens or s.cached + 1 >= self.runner.max_model_len:
            self._finish(s, "length", text, len(text))
        else:
            held = _held_back(text, s.params.stop)
            if len(text) - held > s.emitted:
                s.emit(Output(text[s.emitted:len(text) - held], None, len(s.prompt), len(s.generated)))
                s.emitted = len(text) - held

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # a model without a tokenizer (random weights): its ids, as ladder generate prints
            return "".join(f" {t}" for t in ids)
        return self.tokenizer.decode(ids)

    def _finish(self, s: Sequence, reason: str, text: str, end: int) -> None:
        s.finished = True
        s.emit(Output(text[s.emitted:end], reason, len(s.prompt), len(s.generated)))
        self.metrics.finished(reason, len(s.prompt), time.perf_counter() - s.arrival)

    def _release(self, s: Sequence) -> None:
        """Free a running request's row: the last running row moves into it, the prefilling row after."""
        last = len(self.running) - 1
        if s.row != last:
            mover = self.running[last]
            self.moves.append((last, s.row, mover.cached))
            self.running[s.row], mover.row = mover, s.row
        self.running.pop()
        if self.prefilling is not None and self.prefilling.row != len(self.running):
            self.moves.append((self.prefilling.row, len(self.running), self.prefilling.prefilled))
            self.prefilling.row = len(self.running)

    def _drop_cancelled(self) -> None:
        for s in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(s)
            self._finish(s, "abort", "", 0)
        if self.prefilling is not None and self.prefilling.cancelled:
            self._finish(self.prefilling, "abort", "", 0)
            self.prefilling = None  # its row was the last: nothing moves
        for s in [s for s in self.running if s.cancelled and not s.finished]:
            self._finish(s, "abort", "", 0)
            self._release(s)

    def _live(self) -> list[Sequence]:
        return [*self.waiting, *([self.prefilling] if self.prefilling else []), *self.running]

    def _abort_all(self) -> None:
        for s in self._live():
            if not s.finished:
                self._finish(s, "abort", "", 0)
        self.waiting.clear()
        self.running.clear()
        self.prefilling = None

    def _fail(self, message: str) -> None:
        with self._lock:
            self.failure = message
            for s in self._live():
                if not s.finished:
                    s.finished = True
                    s.emit(Output("", "abort", len(s.prompt), len(s.generated), error=message))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters to hold back: an incomplete UTF-8 character (decoded as U+FFFD), or
    the longest end of the text that may begin a stop string."""
    held = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                held = max(held, n)
                break
    return held
