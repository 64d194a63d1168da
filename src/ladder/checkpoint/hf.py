"""Hugging Face folders in and out: safetensors read slice by slice (a rank never holds more than its
shard of a large matrix), and the one writer of a model folder (`write_hf_files`), which `ladder convert`
and training checkpoints share. config.json's translation is `hf_config`."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ladder.checkpoint.base import Checkpoint, check_shapes
from ladder.checkpoint.hf_config import REMOTE_CODE_FILES, config_to_hf, model_card, read_hf_config
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.errors import LadderError, check_creatable
from ladder.files import check_room, writing
from ladder.model.config import ModelConfig
from ladder.model.weights import ALL, Slice, export_hf_state_dict, random_model

class SafetensorsSource:
    """Tensors of one or more .safetensors files, read slice by slice."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files  # tensor name -> file
        self._handles: dict[Path, Any] = {}
        for file in set(files.values()):
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as exc:
                raise LadderError(f"{file} is not a readable safetensors file ({exc})") from None
        for name, file in files.items():
            if name not in self._handles[file].keys():
                raise LadderError(f"{file.name} has no tensor {name} (the index says it does)")

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.files[name]].get_slice(name).get_shape())

    def get(self, name: str, index: Slice = ALL) -> torch.Tensor:
        part = self._handles[self.files[name]].get_slice(name)
        try:
            tensor = part[index] if len(part.get_shape()) == 2 else part[index[0]]
        except Exception as exc:
            raise LadderError(f"{self.files[name].name}: cannot read {name} ({exc}); truncated file?") from None
        return tensor.float()


def _safetensors_files(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise LadderError(f"{index} is not a safetensors index ({exc})") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise LadderError(f"{folder}: the index names {missing[0]}, which is missing")
        return {name: folder / f for name, f in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise LadderError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as exc:
        raise LadderError(f"{single} is not a readable safetensors file ({exc})") from None


def open_hf(folder: Path) -> Checkpoint:
    config = read_hf_config(folder / "config.json", folder.name)
    source = SafetensorsSource(_safetensors_files(folder))
    check_shapes(folder.name, config, source)
    tokenizer = TextTokenizer.from_hf_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return Checkpoint(folder, "hf", config, source, tokenizer)


# ---- writing ---------------------------------------------------------------------------------------

# What a Hugging Face model folder holds; `--force` replaces a folder holding nothing else.
MODEL_FOLDER_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                      "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "README.md",
                      *REMOTE_CODE_FILES}


def check_replaceable(out: Path, force: bool) -> None:
    """`out` may be new or, with `force`, a model folder: never a file, and never a folder holding
    anything else (`--out . --force` must not delete the working directory)."""
    check_creatable(out)
    if not out.exists():
        return
    if not force:
        raise LadderError(f"{out} exists; pass --force to replace it")
    if not out.is_dir():
        raise LadderError(f"{out} is a file, not a model folder: choose another --out")
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in MODEL_FOLDER_FILES and not (p.is_file() and p.suffix == ".safetensors"))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise LadderError(f"--force replaces a model folder only, and {out} also holds {shown}: "
                          "choose another --out, or remove it yourself")


def write_hf_files(folder: Path, config: ModelConfig, tensors: dict[str, torch.Tensor],
                   tokenizer: TextTokenizer | None, final: Path) -> None:
    """A model's files into an existing folder: config.json, model.safetensors and the tokenizer's files;
    for a layout other than standard, the code transformers runs it with and a README that loads it from
    `final`. Not atomic by itself: callers write into a temporary folder and rename it to `final`
    (`save_hf`, training's checkpoints)."""
    (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    if config.layout != "standard":  # transformers runs the layout with these (trust_remote_code=True)
        for name in REMOTE_CODE_FILES:
            (folder / name).write_bytes(resources.files("ladder.remote_code").joinpath(name).read_bytes())
        (folder / "README.md").write_text(model_card(config, str(final)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_hf(folder)


def save_hf(out: Path, config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: TextTokenizer | None,
            force: bool = False) -> Path:
    """Write a Hugging Face folder atomically: everything goes to a temporary sibling first, which is
    renamed into place only when complete. An existing model folder is replaced only with `force`."""
    out = out.expanduser().resolve()
    check_replaceable(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    check_room(out.parent, needed, f"the model folder {out.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with writing(out, needed):
            write_hf_files(tmp, config, tensors, tokenizer, out)
            if out.exists():
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                out.rename(old)
                tmp.rename(out)
                shutil.rmtree(old)
            else:
                tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_random_hf(out: Path, config: ModelConfig, tokenizer: TextTokenizer | None, seed: int = 0,
                   force: bool = False) -> Path:
    """A folder of seeded random weights in `config`'s shape (`save_hf`): a model for tests and
    experiments that need a checkpoint of a shape no pretrained file has."""
    model = random_model(config, LocalCommunicator(), torch.device("cpu"), seed=seed)
    return save_hf(out, config, export_hf_state_dict(model), tokenizer, force=force)
