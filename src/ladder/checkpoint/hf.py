"""Hugging Face folders in and out: safetensors read slice by slice (a rank never holds more than its
shard of a large matrix), `config.json` to and from `ModelConfig`, and the one writer of a model
folder (`write_hf_folder`), which `ladder convert` and training checkpoints share."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ladder.checkpoint.base import Checkpoint, check_shapes
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.config import ModelConfig, RopeScaling
from ladder.errors import LadderError, check_creatable
from ladder.weights import ALL, Slice

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


def config_from_hf(d: dict[str, Any], label: str) -> ModelConfig:
    archs = d.get("architectures") or []
    if d.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise LadderError(f"{label}: model_type {d.get('model_type')!r} / architectures {archs} are not supported "
                          "(ladder runs llama-architecture models)")
    scaling = None
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                              int(rs["original_max_position_embeddings"]))
    theta = d.get("rope_theta", (rs or {}).get("rope_theta", 10000.0) if isinstance(rs, dict) else 10000.0)
    n_heads = int(d["num_attention_heads"])
    if d.get("head_dim") and int(d["head_dim"]) * n_heads != int(d["hidden_size"]):
        raise LadderError(f"{label}: head_dim {d['head_dim']} x {n_heads} heads != hidden_size {d['hidden_size']} "
                          "(decoupled head sizes are not supported)")
    try:
        return ModelConfig(
            dim=int(d["hidden_size"]), n_layers=int(d["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads), ffn_hidden=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]), rope_theta=float(theta), rope_scaling=scaling,
            norm_eps=float(d.get("rms_norm_eps", 1e-5)), max_seq_len=int(d.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            layout=d.get("residual_layout", "standard"), ladder_layers=d.get("ladder_layers"),
            desync_reduce=d.get("desync_reduce", "mlp"), desync_tp=d.get("desync_tp"), source=str(d.get("_name_or_path", label)))
    except KeyError as exc:
        raise LadderError(f"{label}: config.json lacks {exc}") from None


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.ffn_hidden,
        "vocab_size": config.vocab_size, "rope_theta": config.rope_theta, "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len, "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "head_dim": config.head_dim,
        "dtype": "float32", "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        # ladder's own keys: transformers ignores them (and would run the weights as a standard model)
        "residual_layout": config.layout, "ladder_layers": config.n_ladder_layers if config.layout == "ladder" else None,
        "desync_reduce": config.desync_reduce, "desync_tp": config.desync_tp,
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        d["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                             "high_freq_factor": s.high_freq_factor,
                             "original_max_position_embeddings": s.original_max_position_embeddings}
        d["rope_parameters"] = {**d["rope_scaling"], "rope_theta": config.rope_theta}
    return d


def read_hf_config(config_path: Path, label: str) -> ModelConfig:
    if not config_path.is_file():
        raise LadderError(f"{config_path.parent} has no config.json (not a Hugging Face checkpoint folder)")
    try:
        return config_from_hf(json.loads(config_path.read_text()), label)
    except json.JSONDecodeError as exc:
        raise LadderError(f"{config_path} is not valid JSON ({exc})") from None


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
                      "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "README.md"}


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
                   tokenizer: TextTokenizer | None) -> None:
    """A model's files into an existing folder: config.json, model.safetensors and the tokenizer's files.
    Not atomic by itself: callers write into a temporary folder and rename it (`save_hf`, training's
    checkpoints)."""
    (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_hf_files(tmp, config, tensors, tokenizer)
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
