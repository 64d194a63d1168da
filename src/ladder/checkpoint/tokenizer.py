"""Text at the edges: tokenizers (Hugging Face `tokenizers`) and chat templates (Jinja, as transformers
renders them). The engine never sees text; the CLI turns text into ids and ids back into text here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from ladder.errors import LadderError

# Pre-tokenizer splits for GGUF files that name one (tokenizer.ggml.pre); others use GPT-2's regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                   "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT}


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a tokenizer's chat template


def read_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """A Hugging Face folder's chat template, from every place transformers keeps one, in the order it
    reads them: chat_template.jinja (transformers >= 4.43 saves it there, 5 only there), the
    tokenizer_config.json entry (a string, or named templates of which "default" is used), and a
    processor's chat_template.json."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template:
        return str(template)
    if (folder / "chat_template.json").is_file():
        try:
            return json.loads((folder / "chat_template.json").read_text()).get("chat_template") or None
        except (json.JSONDecodeError, AttributeError):
            raise LadderError(f"{folder / 'chat_template.json'} is not a chat template file") from None
    return None


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: BOS/EOS, and the chat template."""

    def __init__(self, tokenizer: Any, bos_token: str | None, eos_token: str | None, add_bos: bool,
                 chat_template: str | None, is_bytes: bool = False) -> None:
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.is_bytes = is_bytes  # token id = UTF-8 byte value (`bytes`): encoded without the tokenizer

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: Any, label: str) -> TextTokenizer | None:
        """The file's tokenizer, or None when it has none (weights-only files still run on ids).

        `tokenizer.ggml.model` says which kind: `gpt2` (byte-level BPE with merges, Llama 3, SmolLM2,
        Qwen) or `llama` (SentencePiece BPE with scores and byte fallback, Llama 1/2, Mistral, TinyLlama).
        """
        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind is None:
            return None
        tokens: list[str] = field("tokenizer.ggml.tokens")
        if not tokens:
            raise LadderError(f"{label}: the tokenizer has no tokens")
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, field("tokenizer.ggml.merges"), field("tokenizer.ggml.pre", ""), label)
        elif kind == "llama":
            tok = _sentencepiece_bpe(tokens, field("tokenizer.ggml.scores"), field("tokenizer.ggml.merges"),
                                     field("tokenizer.ggml.unknown_token_id"),
                                     bool(field("tokenizer.ggml.add_space_prefix", True)), label)
        else:
            raise LadderError(f"{label}: tokenizer type {kind!r} is not supported (ladder reads byte-level BPE "
                              "'gpt2' and SentencePiece 'llama' tokenizers from GGUF)")
        types = field("tokenizer.ggml.token_type") or []
        # Control tokens (type 3), like <|im_start|>, stay whole and are special; user-defined (4) stay whole.
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind_ in zip(tokens, types) if kind_ == 3])
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind_ in zip(tokens, types) if kind_ == 4])

        def token(key: str) -> str | None:
            i = field(f"tokenizer.ggml.{key}_token_id")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
        add_bos = bool(field("tokenizer.ggml.add_bos_token", kind == "llama"))
        return cls(tok, token("bos"), token("eos"), add_bos, field("tokenizer.chat_template"))

    @classmethod
    def bytes(cls) -> TextTokenizer:
        """UTF-8 bytes as tokens (id = byte value, vocabulary 256): for models trained from scratch."""
        chars = _bytes_to_unicode()  # byte -> the printable stand-in the ByteLevel pre-tokenizer emits
        assert set(chars.values()) == set(ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return cls(tok, None, None, False, None, is_bytes=True)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> TextTokenizer:
        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:
            raise LadderError(f"{folder / 'tokenizer.json'} is not a readable tokenizer ({exc})") from None
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())

        def name(value: Any) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        return cls(tok, name(config.get("bos_token")), name(config.get("eos_token")),
                   bool(config.get("add_bos_token", False)), read_chat_template(folder, config))

    def save_hf(self, folder: Path) -> None:
        """tokenizer.json, tokenizer_config.json, and the chat template where transformers 5 writes it
        (chat_template.jinja) and where older readers look (tokenizer_config.json)."""
        self.tokenizer.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                  "eos_token": self.eos_token, "add_bos_token": self.add_bos, "chat_template": self.chat_template,
                  "clean_up_tokenization_spaces": False}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.chat_template:
            (folder / CHAT_TEMPLATE_FILE).write_text(self.chat_template)

    # ---- use ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def stop_ids(self) -> list[int]:
        ids = {self.token_id(self.eos_token)}
        return sorted(i for i in ids if i is not None)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        # The tokenizer gives the same ids for bytes, but 1.4 us a character: 7 s of every `ladder train`
        # start on the Shakespeare corpus (one pre-token, no merges), against milliseconds here.
        ids = list(text.encode()) if self.is_bytes else self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token)
        if (self.add_bos if add_bos is None else add_bos) and bos is not None:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template rendered as transformers renders it (sandboxed Jinja, trimmed blocks)."""
        if not self.chat_template:
            raise LadderError("this model has no chat template; use --prompt instead of --chat")
        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as exc:
            raise LadderError(f"the chat template failed: {exc}") from None


def _byte_level_bpe(tokens: list[str], merges: list[str] | None, pre: str, label: str) -> Any:
    """GPT-2-style BPE: tokens spelled in the byte alphabet, merges in the file, a split regex by name."""
    if merges is None:
        raise LadderError(f"{label}: the byte-level BPE tokenizer has no merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(merges), fuse_unk=False))
    split = GGUF_PRE_SPLITS.get(pre)
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, merges: list[str] | None,
                       unk_id: int | None, add_space_prefix: bool, label: str) -> Any:
    """SentencePiece BPE as `tokenizers` runs it: spaces become U+2581, a space is prepended to the text,
    characters outside the vocabulary fall back to <0xNN> byte tokens.

    GGUF keeps SentencePiece's piece scores, not merges. SentencePiece merges the adjacent pair whose
    union scores highest, so every split of a piece into two pieces is a merge ranked by that piece's
    score (the conversion transformers and SentencePiece's own extractor use)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    if merges is not None:
        pairs = _merge_pairs(merges)
    elif scores is not None and len(scores) == len(tokens):
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise LadderError(f"{label}: the SentencePiece tokenizer has neither merges nor one score per token")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                 prepend_scheme="first" if add_space_prefix else "never")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if add_space_prefix else []))
    return tok


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """GGUF stores each merge as "left right"."""
    return [tuple(m.split(" ", 1)) for m in merges]  # type: ignore[misc]


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of every piece into two pieces, best-scoring union first. Ties are
    broken as transformers' GGUF converter does (longer left piece, longer right piece, then id order),
    so both read a file's vocabulary the same way."""
    ranked = []
    for piece, score in scores.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), vocab[piece], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (as in every byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
