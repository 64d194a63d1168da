"""What every checkpoint reader returns: the model's config, a `TensorSource` of Hugging Face-named
tensors, and the tokenizer if the file has one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.errors import LadderError
from ladder.model.config import ModelConfig
from ladder.model.weights import TensorSource, hf_names


@dataclass
class Checkpoint:
    """What a loaded checkpoint offers: the config, a tensor source, and the tokenizer if it has one."""

    path: Path
    format: str  # "gguf" or "hf"
    config: ModelConfig
    source: TensorSource
    tokenizer: TextTokenizer | None


def check_shapes(label: str, config: ModelConfig, source: TensorSource) -> None:
    """Every tensor the config implies exists with the implied shape."""
    names = source.names()
    for name, shape in hf_names(config):
        if name not in names:
            raise LadderError(f"{label}: checkpoint has no tensor {name}")
        actual = source.shape(name)
        if tuple(actual) != tuple(shape):
            raise LadderError(f"{label}: tensor {name} has shape {tuple(actual)}, the config implies {tuple(shape)}")
