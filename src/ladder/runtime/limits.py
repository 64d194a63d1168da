"""The checks on token ids and lengths that every entry point makes, each written once: `ladder generate`,
the engine and the server word them alike (the server as a 400, the others as a `LadderError`)."""

from __future__ import annotations

from collections.abc import Iterable

from ladder.errors import LadderError


def vocabulary_error(ids: Iterable[int], vocab_size: int, what: str = "token id") -> str | None:
    """Why `ids` cannot be fed to a model of `vocab_size` tokens, or None."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    return None if bad is None else f"{what} {bad} is outside the vocabulary [0, {vocab_size})"


MAX_SEQ_LEN = "the model's max_seq_len {limit}"


def context_error(prompt_tokens: int, new_tokens: int, limit: int, limit_name: str = MAX_SEQ_LEN) -> str | None:
    """Why a prompt and its new tokens do not fit `limit` positions, or None; `limit_name` names the
    limit, with a {limit} field."""
    total = prompt_tokens + new_tokens
    if total <= limit:
        return None
    return (f"prompt of {prompt_tokens} tokens + {new_tokens} new tokens = {total} exceeds "
            + limit_name.format(limit=limit))


def check_token_ids(ids: Iterable[int], vocab_size: int, what: str = "token id") -> None:
    if (error := vocabulary_error(ids, vocab_size, what)) is not None:
        raise LadderError(error)


def check_context(prompt_tokens: int, new_tokens: int, limit: int, limit_name: str = MAX_SEQ_LEN) -> None:
    if (error := context_error(prompt_tokens, new_tokens, limit, limit_name)) is not None:
        raise LadderError(error)


def check_max_model_len(max_model_len: int, max_seq_len: int) -> None:
    """A server's context (`--max-model-len`) against the model's."""
    if max_model_len > max_seq_len:
        raise LadderError(f"--max-model-len {max_model_len} exceeds the model's max_seq_len {max_seq_len}")
