"""The incremental detokenizer: the text of a whole decode, a piece at a time, cut before stop strings."""

import pytest

from ladder.checkpoint.resolve import open_checkpoint
from ladder.runtime.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! It's 3.14 déjà vu 🙂🙂 naïve café", "  leading spaces\n\ttabs and 中文字符 mixed ",
         "def add(a, b):\n    return a + b\n", "ØÆÅ ü ß ÿ — “quotes” … 👩‍👩‍👧"]


@pytest.fixture(scope="module")
def tokenizer():
    return open_checkpoint("smollm2-135m-instruct").tokenizer


def pieces(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    out = [detokenizer.push(t) for t in ids]
    return out + [detokenizer.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_whole_decode_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_bos=False)
    out = pieces(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(out) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in out)  # multi-byte characters come out whole
    assert sum(bool(p) for p in out) > len(ids) // 2  # it streams: most tokens give text at once


def test_ids_that_never_complete_a_character_come_out_as_a_whole_decode_shows_them(tokenizer):
    ids = tokenizer.encode("ok 中文字符", add_bos=False)[:-1]  # the last character lacks its last byte
    out = pieces(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(out) == tokenizer.decode(ids) and out[-1].endswith("\ufffd")


@pytest.mark.parametrize("stop", ["world", "d! It", "🙂🙂", "ça", "x"])
def test_text_is_cut_before_the_first_stop_string_and_never_shows_it(tokenizer, stop):
    text = TEXTS[0]
    ids = tokenizer.encode(text, add_bos=False)
    detokenizer = IncrementalDetokenizer(tokenizer, (stop, "never there"))
    out = pieces(detokenizer, ids)
    expected = text[:text.index(stop)] if stop in text else text
    assert "".join(out) == expected
    assert detokenizer.stopped == (stop in text)


def test_without_a_tokenizer_the_ids_are_the_text():
    assert "".join(pieces(IncrementalDetokenizer(None, (" 5 6",)), [3, 4, 5, 6, 7])) == " 3 4"
