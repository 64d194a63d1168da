"""The one path from what a command names (a preset, a checkpoint file or folder, a short name, plus
layout options) to a `ModelConfig` and this rank's built, sharded model. Generate, eval, convert,
bench and train all go through `ModelSpec`."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ladder.checkpoint.base import Checkpoint
from ladder.checkpoint.hf_config import config_from_hf
from ladder.checkpoint.resolve import open_checkpoint, resolve_model
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import Communicator
from ladder.comm.distributed import pick_device
from ladder.errors import LadderError
from ladder.model.config import DTYPE_BYTES, ModelConfig, default_dtype, get_preset
from ladder.model.transformer import Transformer
from ladder.model.weights import build_model, fill_random, load_weights
from ladder.quant.quantize import check_quantize, check_shard, quantize_layers, quantize_shard

DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}


def with_layout(config: ModelConfig, layout: str | None, ladder_layers: int | None,
                desync_reduce: str | None = None) -> ModelConfig:
    """A trained model's config converted to another residual layout (weights are unchanged)."""
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


def checkpoint(name_or_path: str) -> Checkpoint:
    """The checkpoint, opened once per process while its file or folder stays the same (its header:
    tensors are read when a rank asks for them). A sweep asks for it at every configuration."""
    stat = resolve_model(name_or_path).stat()
    return _opened(name_or_path, stat.st_ino, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _opened(name_or_path: str, inode: int, mtime_ns: int) -> Checkpoint:
    return open_checkpoint(name_or_path)


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: TextTokenizer | None
    random_weights: bool
    load_s: float
    format: str  # "random", "gguf" or "hf"


@dataclass(frozen=True)
class ModelSpec:
    """A model as a command names it. `model` (a checkpoint) wins over `preset`."""

    preset: str = "tiny"
    model: str | None = None
    layout: str | None = None
    ladder_layers: int | None = None
    desync_reduce: str | None = None
    desync_tp: int | None = None  # a desync model's TP degree (set by training)
    tp: int = 1
    device: str = "auto"
    dtype: str | None = None
    shard_vocab: bool = False
    seed: int = 0
    quantize: str | None = None  # "int8" or "int4" weight-only (ladder.quant.quantize), applied to each shard

    @property
    def label(self) -> str:
        return self.model or self.preset

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    def convert(self, config: ModelConfig) -> ModelConfig:
        """`config` with this spec's layout options applied."""
        config = with_layout(config, self.layout, self.ladder_layers, self.desync_reduce)
        return config.replace(desync_tp=self.desync_tp) if self.desync_tp is not None else config

    def config(self) -> ModelConfig:
        """The model's config in this spec's layout (a checkpoint's header is read, once per process).
        Random weights can take any layout, parallel included; a trained checkpoint's two norms per
        layer cannot become one (`with_layout` refuses it)."""
        if self.model is not None:
            return self.convert(checkpoint(self.model).config)
        return self.convert(get_preset(self.preset, **({"layout": self.layout} if self.layout else {})))

    def validate(self) -> ModelConfig | None:
        """Cheap checks in the launching process, before any worker starts. Returns the config when it
        is known without reading weights (a preset, or a Hugging Face folder's config.json)."""
        if self.model is None:
            config = self.config()
        else:
            path = resolve_model(self.model)
            config_file = path / "config.json"
            if not (path.is_dir() and config_file.is_file()):
                return None  # a GGUF file: its header is read by the workers
            try:
                config = self.convert(config_from_hf(json.loads(config_file.read_text()), path.name))
            except json.JSONDecodeError as exc:
                raise LadderError(f"{config_file} is not valid JSON ({exc})") from None
        config.check_run_tp(self.tp)
        device = pick_device(self.device)
        check_quantize(self.quantize, device.type, self.torch_dtype(device))
        return config

    def dtype_name(self, device: torch.device) -> str:
        return self.dtype or default_dtype(device.type, self.quantize)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        return DTYPES[self.dtype_name(device)]

    def load(self, comm: Communicator, device: torch.device, exact: bool = True,
             simulated_ranks: bool = False) -> LoadedModel:
        """Build this rank's shard and fill it: from the checkpoint, or with seeded random weights
        (`exact`: slices of one whole model, the same function at any TP degree; otherwise drawn in the
        shard directly, for speed benchmarks of models too large to build whole). `simulated_ranks`:
        the whole model of a desync layout whose ranks training simulates (`ladder.train.simulate`),
        not a run at the TP degree it is defined for."""
        start = time.perf_counter()
        config, dtype = self.config(), self.torch_dtype(device)
        if simulated_ranks:
            config.check_tp(comm.world_size)
        else:
            config.check_run_tp(comm.world_size)
        opened = checkpoint(self.model) if self.model is not None else None
        # Quantizing, each block is quantized as soon as it is filled: the unquantized shard is never whole.
        after_block = functools.partial(quantize_layers, mode=self.quantize) if self.quantize else None
        model = build_model(config, comm, device, dtype, shard_vocab=self.shard_vocab, blocks_later=bool(after_block))
        if self.quantize:
            check_shard(model, self.quantize)  # before any weights load
        if opened is None:
            fill_random(model, self.seed, exact, after_block)
        else:
            load_weights(model, opened.source, after_block)
        quantize_shard(model, self.quantize)  # the head, for int8
        tokenizer, source_format = (None, "random") if opened is None else (opened.tokenizer, opened.format)
        return LoadedModel(model.eval(), tokenizer, opened is None, time.perf_counter() - start, source_format)

    def describe(self, loaded: LoadedModel) -> str:
        config = loaded.model.config
        source = f"RANDOM weights (seed {self.seed})" if loaded.random_weights else f"{loaded.format.upper()} weights"
        return (f"{Path(self.label).name}: {config.n_params() / 1e6:.1f}M params, layout {config.layout_name}, "
                f"tp={loaded.model.comm.world_size}, {source}, loaded in {loaded.load_s:.1f} s")
