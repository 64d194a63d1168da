"""Incremental detokenization with stop strings, shared by `ladder generate` and the server.

Each new token decodes only a short window of ids (the offsets of Hugging Face's TGI and vLLM): the
text of ids[prefix:] minus the text of ids[prefix:read], where `read` is where the text last came out
complete and `prefix` one emission before it, so that a tokenizer that spells a token differently at
the start of a text (SentencePiece's leading space) is decoded in context. A window whose text ends in
U+FFFD holds an incomplete UTF-8 character: it waits for the next token. Stop strings are looked for
in the new text and the few characters held back before it, so a token costs O(1), not O(length).
"""

from __future__ import annotations

from ladder.checkpoint.tokenizer import TextTokenizer


class IncrementalDetokenizer:
    """Text out of a stream of token ids, a piece at a time, cut before the first stop string."""

    def __init__(self, tokenizer: TextTokenizer | None, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # token offsets: see the module's docstring
        self.held = ""  # decoded text not given out yet: it may begin a stop string
        self.stopped = False  # a stop string came: nothing more is given out

    def push(self, token_id: int) -> str:
        """The text that `token_id` completes and that is safe to give out (it cannot begin a stop string)."""
        if self.stopped:
            return ""
        text = self.held + self._new_text(token_id)
        hit = _first_stop(text, self.stops)
        if hit >= 0:
            self.stopped, self.held = True, ""
            return text[:hit]
        keep = _stop_prefix_length(text, self.stops)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What is still held back at the end of the output: text that may have begun a stop string, and
        the text of trailing ids that never completed a character (with its U+FFFD, as a full decode has)."""
        if self.stopped:
            return ""
        text, self.held = self.held + self._unfinished_text(), ""
        hit = _first_stop(text, self.stops)
        return text[:hit] if hit >= 0 else text

    def _new_text(self, token_id: int) -> str:
        if self.tokenizer is None:  # a model without a tokenizer (random weights): its ids, as ladder generate prints
            return f" {token_id}"
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def _unfinished_text(self) -> str:
        if self.tokenizer is None or self.read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        return self.tokenizer.decode(self.ids[self.prefix:])[len(before):]


def _first_stop(text: str, stops: tuple[str, ...]) -> int:
    """Where the earliest stop string in `text` begins, or -1."""
    return min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=-1)


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """The longest end of `text` that may begin a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
