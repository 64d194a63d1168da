"""Training text: files, folders, the packaged corpora or the teacher's answers to prompts
(`ladder.train.answers`), tokenised and packed into fixed-length sequences, served as seeded global
batches whose position is just the step (so a resumed run sees the same batches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ladder.corpora import python_docs_text, python_source_text, shakespeare_text
from ladder.errors import LadderError


def read_texts(specs: list[str]) -> list[str]:
    """Texts from files, folders (every *.txt inside), `shakespeare:train|heldout`, `pydoc` or
    `python-source`."""
    texts = []
    for spec in specs:
        if spec.startswith("shakespeare:"):
            texts.append(shakespeare_text(spec.split(":", 1)[1]))
        elif spec == "pydoc":
            texts.append(python_docs_text())
        elif spec == "python-source":
            texts.append(python_source_text())
        else:
            p = Path(spec)
            files = sorted(p.rglob("*.txt")) if p.is_dir() else [p]
            if not p.exists():
                raise LadderError(f"no data file or folder at {spec}")
            if not files:
                raise LadderError(f"the folder {spec} holds no .txt files")
            texts.extend(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not any(t.strip() for t in texts):
        raise LadderError(f"the training data {specs} is empty")
    return texts


def pack(texts: list[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """Tokenise, join with EOS (when the tokenizer has one), cut into (n, seq_len + 1) sequences."""
    eos = tokenizer.token_id(tokenizer.eos_token)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_bos=False))
        if eos is not None:
            ids.append(eos)
    n = len(ids) // (seq_len + 1)
    if n == 0:
        raise LadderError(f"the data has {len(ids)} tokens, fewer than one sequence of {seq_len + 1}")
    return torch.tensor(ids[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


class Batches:
    """Global batches whose position is just the step. One source (or several, without weights): its
    sequences in a seeded order, reshuffled each epoch. Weighted sources: each row of a batch comes from
    a source drawn in proportion to its weight, and is a sequence drawn from that source, both from a
    generator seeded by the step (a small source is seen more often than once an epoch)."""

    def __init__(self, sources: torch.Tensor | list[torch.Tensor], batch_size: int, seed: int,
                 weights: list[float] | None = None) -> None:
        sources = [sources] if isinstance(sources, torch.Tensor) else sources
        self.batch_size, self.seed = batch_size, seed
        self.sources = sources
        self.weights = None if weights is None else torch.tensor(weights, dtype=torch.float64)
        self.sequences = torch.cat(sources)  # (the run's data fingerprint reads them)
        if self.weights is None and len(self.sequences) < batch_size:
            raise LadderError(f"the data holds {len(self.sequences)} sequences, fewer than one batch of {batch_size}")
        self.per_epoch = len(self.sequences) // batch_size

    def global_batch(self, step: int) -> torch.Tensor:
        if self.weights is not None:
            return self._weighted_batch(step)
        epoch, index = divmod(step, self.per_epoch)
        order = torch.randperm(len(self.sequences), generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.sequences[order[index * self.batch_size:(index + 1) * self.batch_size]]

    def _weighted_batch(self, step: int) -> torch.Tensor:
        assert self.weights is not None
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        which = torch.multinomial(self.weights, self.batch_size, replacement=True, generator=generator)
        rows = [self.sources[s][int(torch.randint(len(self.sources[s]), (1,), generator=generator))]
                for s in which.tolist()]
        return torch.stack(rows)
