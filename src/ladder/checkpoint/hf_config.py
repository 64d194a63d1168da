"""`config.json` to and from `ModelConfig`, and what a folder needs so that transformers runs its layout.

Three kinds of folder are read: a plain Llama (standard), ladder's own `ladder_llama` (any other layout,
with the configuration and modeling files of `ladder.remote_code` beside it, loaded by transformers with
`trust_remote_code=True`), and the reference implementation's `llamaLadder`, whose `ladder_layers` is a
count or a list of layer indices. A standard model is written as a plain Llama, which every tool reads;
anything else as `ladder_llama`, so that no tool can run it as a plain Llama by mistake.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ladder import __version__
from ladder.errors import LadderError
from ladder.model.config import ModelConfig, RopeScaling

LLAMA = ("llama", "LlamaForCausalLM")
LADDER = ("ladder_llama", "LadderLlamaForCausalLM")
REFERENCE = ("llamaLadder", "LlamaLadderForCausalLM")  # the paper's code (a LlamaConfig subclass)
REMOTE_CODE_FILES = ("configuration_ladder_llama.py", "modeling_ladder_llama.py")
AUTO_MAP = {"AutoConfig": "configuration_ladder_llama.LadderLlamaConfig",
            "AutoModel": "modeling_ladder_llama.LadderLlamaModel",
            "AutoModelForCausalLM": "modeling_ladder_llama.LadderLlamaForCausalLM"}
TRANSFORMERS_VERSIONS = ">=5.17,<6"  # as pyproject's; 5.17 (the GPU machine's) and 5.24 are tested


def config_from_hf(d: dict[str, Any], label: str) -> ModelConfig:
    kind = _folder_kind(d, label)
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
    if kind == REFERENCE:
        layout = _reference_layout(d.get("ladder_layers"), int(d["num_hidden_layers"]), label)
    else:  # ladder_llama, or a Llama folder (ladder wrote its layout keys into those before ladder_llama existed)
        layout = {"layout": d.get("residual_layout", "standard"), "ladder_layers": d.get("ladder_layers"),
                  "desync_reduce": d.get("desync_reduce", "mlp"), "desync_tp": d.get("desync_tp")}
    try:
        return ModelConfig(
            dim=int(d["hidden_size"]), n_layers=int(d["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads), ffn_hidden=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]), rope_theta=float(theta), rope_scaling=scaling,
            norm_eps=float(d.get("rms_norm_eps", 1e-5)), max_seq_len=int(d.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)), source=str(d.get("_name_or_path", label)),
            **layout)
    except KeyError as exc:
        raise LadderError(f"{label}: config.json lacks {exc}") from None


def _folder_kind(d: dict[str, Any], label: str) -> tuple[str, str]:
    archs = d.get("architectures") or []
    for kind in (LADDER, REFERENCE, LLAMA):
        if d.get("model_type") == kind[0] or kind[1] in archs:
            return kind
    raise LadderError(f"{label}: model_type {d.get('model_type')!r} / architectures {archs} are not supported "
                      "(ladder runs llama-architecture models)")


def _reference_layout(ladder_layers: int | Sequence[int] | None, n_layers: int, label: str) -> dict[str, Any]:
    """The reference format's `ladder_layers` (a count of trailing layers, or their indices; none: a
    standard model) as ladder's layout. Ladder runs the ladder recurrence on the last N layers only."""
    if isinstance(ladder_layers, int) and not isinstance(ladder_layers, bool):
        indices = list(range(n_layers - ladder_layers, n_layers))
    elif ladder_layers is None or isinstance(ladder_layers, list):
        indices = sorted(int(i) for i in ladder_layers or [])
    else:
        raise LadderError(f"{label}: ladder_layers must be a count or a list of layer indices, got {ladder_layers!r}")
    if not indices:
        return {"layout": "standard"}
    if indices != list(range(n_layers - len(indices), n_layers)):
        raise LadderError(f"{label}: ladder_layers {indices} are not the last {len(indices)} of {n_layers} layers; "
                          "ladder runs the ladder recurrence on the last N layers only")
    return {"layout": "ladder", "ladder_layers": len(indices)}


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """config.json of a folder: a plain Llama for the standard layout, `ladder_llama` for every other."""
    standard = config.layout == "standard"
    model_type, architecture = LLAMA if standard else LADDER
    d: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type, "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.ffn_hidden,
        "vocab_size": config.vocab_size, "rope_theta": config.rope_theta, "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len, "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "head_dim": config.head_dim,
        "dtype": "float32", "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
    }
    if not standard:
        d |= {"auto_map": AUTO_MAP, "residual_layout": config.layout,
              "ladder_layers": config.n_ladder_layers if config.layout == "ladder" else None,
              "desync_reduce": config.desync_reduce, "desync_tp": config.desync_tp}
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


def model_card(config: ModelConfig, name: str) -> str:
    """README.md of a ladder_llama folder: what it is and the lines that load it."""
    runs_in_transformers = config.layout not in ("desync", "upper-bound")
    use = (f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
```

`trust_remote_code=True` runs `modeling_ladder_llama.py` from this folder (transformers' own Llama
attention, MLP and norms; the layout in one loop). Without it transformers refuses the folder: run as a
plain Llama, the same weights would give other answers. (The tokenizer is a plain one; the flag only
saves transformers from asking about the folder's code while it reads the configuration.)""" if runs_in_transformers else
           f"""This layout keeps one residual stream per tensor-parallel rank, so it is defined only for its TP
degree and sharding, and transformers refuses it with a one-line reason. Run it with ladder:
`ladder generate --model {name} --tp N`.""")
    return f"""---
library_name: transformers
tags: [ladder-residual, custom_code]
---
# {name}

A Ladder-Residual Llama (Zhang et al., ICML 2025): {config.layout_name}, {config.n_layers} layers,
written by ladder {__version__}. Needs transformers {TRANSFORMERS_VERSIONS}.

{use}

vLLM: its Transformers backend loads `auto_map` models, so this folder is expected to serve there with
`--trust-remote-code`; ladder has not run it in vLLM.
"""
