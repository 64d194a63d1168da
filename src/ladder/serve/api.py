"""The HTTP side: the OpenAI routes on FastAPI, every error an OpenAI error object.

A request becomes token ids and `GenerationParams` here, checked against the model (context length,
vocabulary, what the server cannot honour) before it reaches the scheduler; its outputs come back
through an asyncio queue that the engine thread feeds (`loop.call_soon_threadsafe`). A client that
goes away, streaming or not, cancels its request, which frees its KV-cache row at the next step.
"""

import asyncio
import functools
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.runtime.limits import vocabulary_error
from ladder.runtime.sampling import SamplingParams
from ladder.serve.metrics import ServerMetrics
from ladder.serve.protocol import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                   ChatCompletionRequest, ChatDelta, ChatMessageOut, Completion, CompletionChoice,
                                   CompletionLogprobs, CompletionRequest, ErrorBody, ErrorResponse, ModelCard,
                                   ModelList, SamplingFields, Usage, new_id)
from ladder.serve.scheduler import (GenerationParams, Output, QueueFull, Scheduler, Sequence, TokenLogprob,
                                    Unavailable)

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass
class ServerState:
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    vocab_size: int = 0
    tokenizer: TextTokenizer | None = None
    scheduler: Scheduler | None = None  # set once the model is loaded
    api_key: str | None = field(default=None, repr=False)  # required on /v1/* when set (as vLLM's --api-key)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.retry_after_s = status, kind, param, code, retry_after_s

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=str(self), type=self.kind, param=self.param, code=self.code))
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


if TYPE_CHECKING:
    from fastapi import FastAPI


def create_app(state: ServerState) -> "FastAPI":
    # fastapi is imported here, not with the module: importing it costs every `ladder` command 0.2 s
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(title="ladder", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    if state.api_key is not None:
        _require_api_key(app, state.api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = "the body is not valid JSON" if first.get("type") == "json_invalid" else first["msg"]
        return ApiError(400, f"{where}: {message}" if where else message, param=where or None).response()

    @app.get("/health")
    async def health() -> Response:
        ready = state.scheduler is not None and state.scheduler.failure is None and not state.scheduler.stopping
        return Response(status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.max_model_len)])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | BaseModel:
        prompt = _completion_prompt(state, body)
        params = _params(state, body, len(prompt), body.max_tokens, body.top_logprobs, body.echo)
        outputs = _generate(state, prompt, params, request)
        if body.stream:
            return _stream(_completion_chunks(state, body, outputs))
        return _completion(state, body, prompt, await _collect(outputs))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response | BaseModel:
        prompt = _chat_prompt(state, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        outputs = _generate(state, prompt, _params(state, body, len(prompt), max_tokens), request)
        if body.stream:
            return _stream(_chat_chunks(state, body, outputs))
        text, last, _ = await _collect(outputs)
        return ChatCompletion(model=state.model_name, usage=Usage.of(last.prompt_tokens, last.completion_tokens),
                              choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=last.finish_reason)])

    return app


def _require_api_key(app: "FastAPI", api_key: str) -> None:
    """/v1/* answers 401 without `Authorization: Bearer <api_key>`, as vLLM's --api-key; /health and
    /metrics stay open."""
    @app.middleware("http")
    async def require_api_key(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/v1") and not _authorized(request, api_key):
            return ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                            code="invalid_api_key").response()
        return await call_next(request)


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compared in constant time, as bytes (a header may hold any character)
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


# ---- requests into token ids and parameters ---------------------------------------------------------

def _encode(state: ServerState, text: str, param: str, add_bos: bool | None = None) -> list[int]:
    """Text into token ids; text that is not valid Unicode (JSON can carry a lone surrogate, "\\ud800",
    which no UTF-8 encodes) is the client's error."""
    assert state.tokenizer is not None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"the text is not valid Unicode ({exc.reason} at character {exc.start})",
                       param=param) from None
    return state.tokenizer.encode(text, add_bos=add_bos)


def _check_model(state: ServerState, body: SamplingFields) -> None:
    if body.model != state.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       "not_found_error", "model", "model_not_found")
    if (unsupported := body.unsupported()) is not None:
        raise ApiError(400, unsupported[1], param=unsupported[0])


def _completion_prompt(state: ServerState, body: CompletionRequest) -> list[int]:
    _check_model(state, body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request: send several requests", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        ids = _encode(state, prompt, "prompt")
    else:
        ids = list(prompt)
        if (error := vocabulary_error(ids, state.vocab_size)) is not None:
            raise ApiError(400, error, param="prompt")
    return _check_length(state, ids)


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    _check_model(state, body)
    if state.tokenizer is None or not state.tokenizer.chat_template:
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = state.tokenizer.render_chat(messages)
    except Exception as exc:  # noqa: BLE001 (a template's own raise_exception, or a bad part: the client's error)
        raise ApiError(400, f"the messages do not fit the chat template: {exc}", param="messages") from None
    return _check_length(state, _encode(state, text, "messages", add_bos=False))


def _check_length(state: ServerState, ids: list[int]) -> list[int]:
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(ids) >= state.max_model_len:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; this server's context is {state.max_model_len} "
                       "tokens (--max-model-len), the prompt and at least one new token", param="prompt",
                       code="context_length_exceeded")
    return ids


def _prompt_text(state: ServerState, body: CompletionRequest, ids: list[int]) -> str:
    """The prompt as echo gives it back: the text sent, or the text of the ids sent."""
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list)) \
        else body.prompt
    if isinstance(prompt, str):
        return prompt
    return state.tokenizer.decode(ids, skip_special=False) if state.tokenizer is not None else ""


def _params(state: ServerState, body: SamplingFields, prompt_tokens: int, max_tokens: int | None,
            logprobs: int | None = None, echo: bool = False) -> GenerationParams:
    room = state.max_model_len - prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) exceed this server's "
                       f"context of {state.max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    if (error := vocabulary_error(body.stop_token_ids or [], state.vocab_size, "stop token id")) is not None:
        raise ApiError(400, error, param="stop_token_ids")
    top_k = body.top_k if body.top_k not in (None, -1, 0) else None
    return GenerationParams(room if max_tokens is None else max_tokens, SamplingParams(body.temperature, top_k, body.top_p),
                            body.seed, body.stop_strings(), frozenset(body.stop_token_ids or ()), body.ignore_eos,
                            logprobs=logprobs, prompt_logprobs=echo and logprobs is not None)


# ---- outputs ------------------------------------------------------------------------------------------

def _generate(state: ServerState, prompt: list[int], params: GenerationParams,
              request: Request) -> AsyncIterator[Output]:
    """Submit the request (refused here, before any response starts, when the server cannot take it)
    and return its outputs as the engine produces them."""
    if state.scheduler is None:
        raise ApiError(503, "the model is still loading", "service_unavailable", retry_after_s=5)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    try:
        sequence = state.scheduler.submit(prompt, params, functools.partial(_deliver, loop, queue))
    except QueueFull as exc:
        raise ApiError(503, f"the server is at capacity: {exc}", "server_overloaded", retry_after_s=1) from None
    except Unavailable as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    return _outputs(state.scheduler, sequence, queue, request)


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, out: Output) -> None:
    """Hand an output from the engine thread to its request's handler; dropped once the HTTP server's loop
    has closed (its handlers are gone, and the engine thread must not fail on it)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, out)
    except RuntimeError:  # "Event loop is closed"
        pass


async def _outputs(scheduler: Scheduler, sequence: Sequence, queue: asyncio.Queue,
                   request: Request) -> AsyncIterator[Output]:
    """Cancelled, freeing the request's row, when the consumer stops early or the client goes away."""
    finished = False
    try:
        while not finished:
            try:
                out = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if out.error is not None:
                raise ApiError(503, out.error, "service_unavailable")
            finished = out.finish_reason is not None
            yield out
    finally:
        if not finished:
            scheduler.cancel(sequence)


async def _collect(outputs: AsyncIterator[Output]) -> tuple[str, Output, list[Output]]:
    """The whole text, the last output and every output."""
    collected = [out async for out in outputs]
    if not collected:  # the client went away: nobody reads this answer
        raise ApiError(499, "the client closed the request")
    return "".join(out.text for out in collected), collected[-1], collected


def _completion(state: ServerState, body: CompletionRequest, prompt: list[int],
                collected: tuple[str, Output, list[Output]]) -> Completion:
    """A whole completion: its text (after the prompt's, with echo) and its tokens' log-probabilities (the
    prompt's first, with echo)."""
    text, last, outputs = collected
    echoed = _prompt_text(state, body, prompt) if body.echo else ""
    logprobs = None
    if body.top_logprobs is not None:
        entries = [*(last.prompt_logprobs or []), *(e for out in outputs for e in out.logprobs)]
        logprobs = _logprobs_body(state, entries, 0)
    choice = CompletionChoice(text=echoed + text, finish_reason=last.finish_reason, logprobs=logprobs)
    return Completion(model=state.model_name, choices=[choice], usage=Usage.of(last.prompt_tokens, last.completion_tokens))


def _spell(state: ServerState, token: int) -> str:
    return state.tokenizer.decode([token], skip_special=False) if state.tokenizer is not None else str(token)


def _logprobs_body(state: ServerState, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """OpenAI's logprobs object for these tokens, their text starting at character `offset`."""
    tokens = [_spell(state, e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops = [None if e.logprob is None else {_spell(state, t): v for t, v in e.top.items()} for e in entries]
    return CompletionLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries], top_logprobs=tops,
                              text_offset=offsets)


def _stream(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events as OpenAI (and vLLM) send them: `data: <json>` per chunk, then `data: [DONE]`."""
    async def encoded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield _sse(event.model_dump_json(exclude_none=False))
        except ApiError as exc:  # the engine failed mid-stream: say so in the stream, as vLLM does
            yield _sse(exc.response().body.decode())
        yield _sse("[DONE]")
    return StreamingResponse(encoded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def _completion_chunks(state: ServerState, body: CompletionRequest,
                             outputs: AsyncIterator[Output]) -> AsyncIterator[BaseModel]:
    id_, last, offset = new_id("cmpl"), None, 0
    async for out in outputs:
        last = out
        logprobs = _logprobs_body(state, out.logprobs, offset) if body.top_logprobs is not None else None
        offset += len(out.text)
        yield Completion(id=id_, model=state.model_name, choices=[
            CompletionChoice(text=out.text, finish_reason=out.finish_reason, logprobs=logprobs)])
    if last is not None and body.stream_options and body.stream_options.include_usage:
        yield Completion(id=id_, model=state.model_name, choices=[], usage=Usage.of(last.prompt_tokens,
                                                                                   last.completion_tokens))


async def _chat_chunks(state: ServerState, body: ChatCompletionRequest,
                       outputs: AsyncIterator[Output]) -> AsyncIterator[BaseModel]:
    id_, last = new_id("chatcmpl"), None
    yield ChatCompletionChunk(id=id_, model=state.model_name,
                              choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    async for out in outputs:
        last = out
        yield ChatCompletionChunk(id=id_, model=state.model_name, choices=[
            ChatChunkChoice(delta=ChatDelta(content=out.text), finish_reason=out.finish_reason)])
    if last is not None and body.stream_options and body.stream_options.include_usage:
        yield ChatCompletionChunk(id=id_, model=state.model_name, choices=[],
                                  usage=Usage.of(last.prompt_tokens, last.completion_tokens))
