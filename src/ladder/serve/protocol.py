"""The OpenAI API's requests and responses, as vLLM serves them (its `top_k`, `stop_token_ids` and
`ignore_eos` extensions included). Fields the server cannot honour are refused in `check`, never ignored
silently: a client asking for log-probabilities must not get an answer without them."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # the most likely tokens a position may list (vLLM's default limit)

class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")  # as vLLM: unknown fields (`user`, ...) change nothing

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 mean off
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what a torch generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field this server cannot honour."""
        if self.n != 1:
            return "n", "n > 1 is not supported: send one request per completion"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not supported"
        return None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # the OpenAI default for completions; 0 scores the prompt (echo)
    echo: bool = False  # the prompt before the completion, with its log-probabilities when logprobs is set

    def unsupported(self) -> tuple[str, str] | None:
        if (found := super().unsupported()) is not None:
            return found
        if self.logprobs is not None and not 0 <= int(self.logprobs) <= MAX_LOGPROBS:
            return "logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"
        if self.echo and self.stream:
            return "echo", "echo is not supported with stream: send a request without stream"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 needs echo (it scores the prompt and generates nothing)"
        return None

    @property
    def top_logprobs(self) -> int | None:
        """How many likely tokens each position lists; None: no log-probabilities asked for."""
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The text of a message whose content is a string or a list of parts (only text parts)."""
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise ValueError("only text content parts are supported")
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs not in (None, False):
            return "logprobs", "logprobs are supported on /v1/completions, not on chat completions"
        return super().unsupported()


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Response(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format, one entry per token (the prompt's first, with echo)."""
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text begins in the choice's text


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletion(_Response):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ladder"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
