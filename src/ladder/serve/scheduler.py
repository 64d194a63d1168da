"""Rank 0's scheduler: continuous batching with chunked prefill, in vLLM v1's shape.

The scheduler only plans. Requests join the batch at step boundaries and leave it when done, each at its
own position with its own sampling parameters and stop conditions. A step has a token budget
(`max_num_batched_tokens`, vLLM's name): one token of every running request, then prompt chunks of the
requests being prefilled, oldest first, as many as the budget holds. So a burst of arrivals prefills
together, and a long prompt delays the running requests by one budget's forward at most. A step ends
with its sampling: every row in one call (`ladder.runtime.sampling`), giving a typed `StepOutput`; then
the scheduler advances each request (its text from its incremental detokenizer, its stop strings, its
`FinishReason`). A finished, cancelled or disconnected request gives its KV-cache row back at once
(the running rows first: `ladder.serve.steps`).

The HTTP side (`ladder.serve.api`) calls `submit` and `cancel` from its thread; `run` is the engine
thread's loop. The lock guards only what both threads touch (the waiting queue, the flags): the batch
is the engine thread's alone, so sampling, detokenizing and stop strings run outside it, and a handler
never waits for them to submit. Outputs go back through each request's `emit` callback, called on the
engine thread.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.errors import LadderError, communication_failure
from ladder.runtime.detokenizer import IncrementalDetokenizer
from ladder.runtime.engine import Engine, PrefillChunk
from ladder.runtime.sampling import SamplingBatch, SamplingParams, sample
from ladder.serve.metrics import ServerMetrics
from ladder.serve.steps import StepLogits, StepPlan, run_plan, share_plan

HEARTBEAT_S = 1.0  # an idle server still sends empty plans: the other ranks' wait must not time out


class QueueFull(Exception):
    """The waiting queue is at its bound: the client should retry later (HTTP 503 with Retry-After)."""


class Unavailable(Exception):
    """The engine failed (a rank died) or is shutting down: no new requests."""


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int  # 0: score the prompt only (with prompt_logprobs)
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()  # stop strings: never part of the output
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # each new token's log-probability and this many most likely tokens'
    prompt_logprobs: bool = False  # the same for every prompt token (OpenAI's echo with logprobs)


class FinishReason(str, Enum):
    """Why a request ended, as OpenAI's API spells it."""
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens, or the context is full
    ABORT = "abort"  # cancelled, disconnected, or the server stopped or failed


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability (natural log, of the model's distribution before any sampling setting)
    and the most likely tokens' at its position, as ids (the HTTP side spells them)."""
    token: int
    logprob: float | None  # None for a prompt's first token: nothing predicts it
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Output:
    """New output of one request, in order. `text` is what is new since the previous Output."""
    text: str
    finish_reason: FinishReason | None  # None while running
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens generated since the previous Output
    prompt_logprobs: list[TokenLogprob] | None = None  # every prompt token's, on the last Output


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: GenerationParams
    emit: Callable[[Output], None]
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    arrival: float = field(default_factory=time.perf_counter)
    row: int = -1
    prefilled: int = 0  # prompt tokens in the KV cache
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    last_token_at: float = 0.0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # filled chunk by chunk
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens not yet in an Output

    @property
    def cached(self) -> int:
        """Positions written in this request's KV-cache row (the newest token is not yet)."""
        return self.prefilled + max(len(self.generated) - 1, 0)


@dataclass(frozen=True)
class SampledToken:
    sequence: Sequence
    token: int
    logprob: TokenLogprob | None  # when the request asks for log-probabilities


@dataclass(frozen=True)
class StepOutput:
    """What a step gives the scheduler: the prompt tokens each prefill chunk wrote (in the plan's order), and
    the new token of every row that samples one (the running rows, then the prompts completed this step)."""
    prefilled: list[int]
    sampled: list[SampledToken]


class Scheduler:
    """Plans the steps of `engine`, whose cache rows (`Engine.reserve`, padded) are the batch's bound."""

    def __init__(self, engine: Engine, tokenizer: TextTokenizer | None, metrics: ServerMetrics, max_waiting: int,
                 max_num_batched_tokens: int, group: dist.ProcessGroup | None = None, world_size: int = 1,
                 max_prefill_while_decoding: int | None = None) -> None:
        max_batch = engine.max_batch
        if max_num_batched_tokens < max_batch:
            raise LadderError(f"--max-num-batched-tokens {max_num_batched_tokens} is below --max-batch {max_batch}: "
                              "a step must hold one token of every running request")
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.max_batch, self.max_waiting, self.token_budget = max_batch, max_waiting, max_num_batched_tokens
        self.max_prefill_while_decoding = max_prefill_while_decoding
        self.group, self.world_size = group, world_size
        self.eos_ids = frozenset(tokenizer.stop_ids) if tokenizer is not None else frozenset()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] holds KV-cache row i
        self.prefilling: list[Sequence] = []  # hold the rows after the running ones, in order
        self.moves: list[tuple[int, int, int]] = []  # row moves the next plan carries
        self.failure: str | None = None
        self.stopping = False
        self._ids = itertools.count()
        self._lock = threading.Condition()

    # ---- the HTTP side ----------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: GenerationParams, emit: Callable[[Output], None]) -> Sequence:
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        generator = torch.Generator(self.engine.device).manual_seed(seed)
        sequence = Sequence(next(self._ids), prompt, params, emit, generator,
                            IncrementalDetokenizer(self.tokenizer, params.stop))
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
                logits = run_plan(self.engine, plan)
                if logits.every_position is not None:
                    self._score_prompts(plan, logits.every_position)
                self._advance(self._sample(plan, logits))
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
                self.metrics.running.set(len(self.running) + len(self.prefilling))
                self.metrics.waiting.set(len(self.waiting))
                held = sum(s.cached for s in [*self.running, *self.prefilling])
                self.metrics.kv_cache_usage.set(held / (self.engine.max_batch * self.engine.max_seq))
                if self.running or self.prefilling:
                    return self._plan()
                if self.moves:
                    return self._plan()  # no compute: the rows to move
                if not self._lock.wait(HEARTBEAT_S) and self.world_size > 1:
                    return self._plan()  # idle for a second: a heartbeat for the other ranks

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            s = self.waiting.popleft()
            s.row = len(self.running) + len(self.prefilling)
            self.prefilling.append(s)

    def _plan(self) -> StepPlan:
        plan = StepPlan(moves=self.moves)
        self.moves = []
        for s in self.running:
            plan.decode_tokens.append(s.generated[-1])
            plan.decode_positions.append(s.cached)
        budget = self.token_budget - len(self.running)
        if self.running and self.max_prefill_while_decoding:  # the running streams wait for this step's prefill
            budget = min(budget, self.max_prefill_while_decoding)
        for s in self.prefilling:  # oldest first: a request gets tokens only once the ones before it are all in
            if budget <= 0:
                break
            chunk = s.prompt[s.prefilled:s.prefilled + budget]
            plan.prefill.append(PrefillChunk(s.row, chunk, s.prefilled, every_position=s.params.prompt_logprobs))
            budget -= len(chunk)
        return plan

    def _score_prompts(self, plan: StepPlan, every_position: torch.Tensor) -> None:
        """Each prompt token's log-probability, for the chunks that ask (their sequences are the first
        prefilling ones, in order: `_plan`). Runs on the engine thread, which alone changes `prefilling`."""
        for chunk, s, logits in zip(plan.prefill, self.prefilling, every_position):
            if chunk.every_position:
                s.prompt_logprobs += prompt_logprobs(logits, chunk, s.prompt, s.params.logprobs or 0)

    def _sample(self, plan: StepPlan, step: StepLogits) -> StepOutput:
        """The step's sampling: a token for each running row and each prompt this step completes (the
        first chunks: `_plan`), all rows in one call, and the log-probabilities asked for."""
        rows = self.running[:len(plan.decode_tokens)]
        logits = [step.decoded] if step.decoded is not None else []
        completing = [s for chunk, s in zip(plan.prefill, self.prefilling)
                      if s.prefilled + len(chunk.tokens) == len(s.prompt)]
        if completing:
            assert step.prefilled is not None
            rows, logits = [*rows, *completing], [*logits, step.prefilled[:len(completing)]]
        wanted = [i for i, s in enumerate(rows) if s.params.max_tokens > 0]  # 0: the prompt scored, no token
        sampled: list[SampledToken] = []
        if wanted:
            step_logits = torch.cat(logits)
            step_logits = step_logits if len(wanted) == len(rows) else step_logits[wanted]
            rows = [rows[i] for i in wanted]
            batch = SamplingBatch.of([s.params.sampling for s in rows], [s.generator for s in rows],
                                     step_logits.shape[-1], step_logits.device)
            tokens = sample(step_logits, batch).tolist()  # the step's one transfer to the host
            sampled = [SampledToken(s, token, None if s.params.logprobs is None
                                    else token_logprob(row_logits, token, s.params.logprobs))
                       for s, token, row_logits in zip(rows, tokens, step_logits)]
        return StepOutput([len(chunk.tokens) for chunk in plan.prefill], sampled)

    def _advance(self, out: StepOutput) -> None:
        """Each request after a step: prompts written (those complete join the running rows), new tokens
        accepted, and the rows of the requests that finished freed."""
        now = time.perf_counter()
        complete = 0  # the chunks that end their prompt: the first ones (see `_plan`)
        for written, s in zip(out.prefilled, self.prefilling):
            s.prefilled += written
            if s.prefilled == len(s.prompt):
                complete += 1
                self.metrics.time_to_first_token.observe(now - s.arrival)
                if s.params.max_tokens == 0:  # the prompt's log-probabilities are all it asked for
                    self._finish(s, FinishReason.LENGTH)
        joined, self.prefilling = self.prefilling[:complete], self.prefilling[complete:]
        self.running += joined  # their rows follow the running ones already
        for new in out.sampled:
            if new.logprob is not None:
                new.sequence.new_logprobs.append(new.logprob)
            self._accept(new.sequence, new.token, now)
        self._release([s for s in self.running if s.finished])

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
            self._finish(s, FinishReason.STOP, s.detokenizer.flush())
            return
        text = s.detokenizer.push(token)
        if s.detokenizer.stopped:
            self._finish(s, FinishReason.STOP, text)
        elif len(s.generated) >= s.params.max_tokens or s.cached + 1 >= self.engine.max_seq:
            self._finish(s, FinishReason.LENGTH, text + s.detokenizer.flush())
        elif text:
            s.emit(Output(text, None, len(s.prompt), len(s.generated), logprobs=s.new_logprobs))
            s.new_logprobs = []

    def _finish(self, s: Sequence, reason: FinishReason, text: str = "") -> None:
        s.finished = True
        prompt = s.prompt_logprobs if s.params.prompt_logprobs else None
        s.emit(Output(text, reason, len(s.prompt), len(s.generated), logprobs=s.new_logprobs, prompt_logprobs=prompt))
        s.new_logprobs = []
        self.metrics.finished(reason.value, len(s.prompt), time.perf_counter() - s.arrival)

    def _release(self, leaving: list[Sequence]) -> None:
        """Free the rows of requests that left: the last running row moves into each running one's place,
        then the prefilling rows move down behind the running ones. Every move goes to a lower row, in
        order of target: no row is overwritten before it is copied."""
        for s in leaving:
            if s in self.prefilling:
                self.prefilling.remove(s)
                continue
            index = self.running.index(s)
            self.running[index] = self.running[-1]
            self.running.pop()
        for row, s in enumerate([*self.running, *self.prefilling]):
            if s.row != row:
                self.moves.append((s.row, row, s.cached))
                s.row = row

    def _drop_cancelled(self) -> None:
        for s in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(s)
            self._finish(s, FinishReason.ABORT)
        leaving = [s for s in [*self.running, *self.prefilling] if s.cancelled and not s.finished]
        for s in leaving:
            self._finish(s, FinishReason.ABORT)
        self._release(leaving)

    def _live(self) -> list[Sequence]:
        return [*self.waiting, *self.prefilling, *self.running]

    def _abort_all(self) -> None:
        for s in self._live():
            if not s.finished:
                self._finish(s, FinishReason.ABORT)
        self.waiting.clear()
        self.running.clear()
        self.prefilling.clear()

    def _fail(self, message: str) -> None:
        with self._lock:
            self.failure = message
            for s in self._live():
                if not s.finished:
                    s.finished = True
                    s.emit(Output("", FinishReason.ABORT, len(s.prompt), len(s.generated), error=message))



def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under the next-token logits (V,), and the `top` most likely tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = logp.topk(top) if top else None
    return TokenLogprob(token, float(logp[token]),
                        dict(zip(best.indices.tolist(), best.values.tolist())) if best is not None else {})


def prompt_logprobs(logits: torch.Tensor, chunk: PrefillChunk, prompt: list[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of the prompt tokens a chunk's positions predict: logits (T, V) of a row whose
    last len(chunk.tokens) positions are the chunk's (left-padded). Position p predicts token p + 1, so a
    chunk scores the tokens after each of its own, the first of the next chunk included; the prompt's
    first token, which nothing predicts, gets None."""
    n = len(chunk.tokens)
    targets = prompt[chunk.start + 1:chunk.start + n + 1]  # the last chunk's last position predicts no prompt token
    logp = torch.log_softmax(logits[-n:][:len(targets)].float(), dim=-1)  # (n or n - 1, V)
    picked = logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None])[:, 0].tolist()
    best = logp.topk(top, dim=-1) if top else None
    entries = [TokenLogprob(prompt[0], None)] if chunk.start == 0 else []
    for i, (token, value) in enumerate(zip(targets, picked)):
        tops = dict(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else {}
        entries.append(TokenLogprob(token, value, tops))
    return entries
