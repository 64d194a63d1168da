"""Training text: files, folders or the packaged corpora, tokenised and packed into fixed-length
sequences, served as seeded global batches whose position is just the step (so a resumed run sees the
same batches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ladder.corpora import python_docs_text, shakespeare_text
from ladder.errors import LadderError


def read_texts(specs: list[str]) -> list[str]:
    """Texts from files, folders (every *.txt inside) or `shakespeare:train|heldout`."""
    texts = []
    for spec in specs:
        if spec.startswith("shakespeare:"):
            texts.append(shakespeare_text(spec.split(":", 1)[1]))
        elif spec == "pydoc":
            texts.append(python_docs_text())
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
    """Global batches in a seeded order, reshuffled each epoch; the position is just the step."""

    def __init__(self, sequences: torch.Tensor, batch_size: int, seed: int) -> None:
        if len(sequences) < batch_size:
            raise LadderError(f"the data holds {len(sequences)} sequences, fewer than one batch of {batch_size}")
        self.sequences, self.batch_size, self.seed = sequences, batch_size, seed
        self.per_epoch = len(sequences) // batch_size

    def global_batch(self, step: int) -> torch.Tensor:
        epoch, index = divmod(step, self.per_epoch)
        order = torch.randperm(len(self.sequences), generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.sequences[order[index * self.batch_size:(index + 1) * self.batch_size]]
