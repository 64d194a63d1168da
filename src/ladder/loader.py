"""What to run: a preset with random weights or a real checkpoint, converted to a residual layout,
and materialised on one tensor-parallel rank. Shared by generate, eval, convert and bench."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ladder.config import ModelConfig, get_preset
from ladder.distributed import Communicator
from ladder.errors import LadderError
from ladder.model import Transformer
from ladder.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    """A model as the command line names it. `model` (a checkpoint) wins over `preset`."""

    preset: str = "tiny"
    model: str | None = None
    layout: str | None = None
    ladder_layers: int | None = None
    desync_reduce: str | None = None
    tp: int = 1
    device: str = "auto"
    dtype: str | None = None
    shard_vocab: bool = False
    seed: int = 0

    @property
    def label(self) -> str:
        return self.model or self.preset

    def convert(self, config: ModelConfig) -> ModelConfig:
        """`config` with this spec's layout, ladder_layers and desync pattern applied."""
        from ladder.checkpoint import with_layout

        return with_layout(config, self.layout, self.ladder_layers, self.desync_reduce)

    def preset_config(self) -> ModelConfig:
        """The preset built in this spec's layout: random weights can take any, parallel included. (Only
        a trained checkpoint's two norms per layer cannot become one, which `convert` refuses.)"""
        return self.convert(get_preset(self.preset, **({"layout": self.layout} if self.layout else {})))

    def validate(self) -> ModelConfig | None:
        """Cheap checks in the launching process, before any worker starts. Returns the config when it
        is known without reading weights (a preset, or a Hugging Face folder's config.json)."""
        if self.model is None:
            config = self.preset_config()
        else:
            from ladder.checkpoint import config_from_hf, resolve_model

            path = resolve_model(self.model)
            config_file = path / "config.json"
            if not (path.is_dir() and config_file.is_file()):
                return None  # a GGUF file: its header is read by the workers
            try:
                config = self.convert(config_from_hf(json.loads(config_file.read_text()), path.name))
            except json.JSONDecodeError as exc:
                raise LadderError(f"{config_file} is not valid JSON ({exc})") from None
        config.check_run_tp(self.tp)
        return config

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: TextTokenizer | None
    random_weights: bool
    load_s: float
    format: str  # "random", "gguf" or "hf"


def load_model(spec: ModelSpec, comm: Communicator, device: torch.device) -> LoadedModel:
    """Build this rank's shard of the model the spec names and fill it (random or from a checkpoint)."""
    from ladder.weights import build_model, load_weights, random_model

    start = time.perf_counter()
    dtype = spec.torch_dtype(device)
    if spec.model is None:
        config = spec.preset_config()
        config.check_run_tp(comm.world_size)
        model = random_model(config, comm, device, dtype, seed=spec.seed, shard_vocab=spec.shard_vocab)
        return LoadedModel(model.eval(), None, True, time.perf_counter() - start, "random")
    from ladder.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(spec.model)
    config = spec.convert(checkpoint.config)
    config.check_run_tp(comm.world_size)
    model = build_model(config, comm, device, dtype, shard_vocab=spec.shard_vocab)
    load_weights(model, checkpoint.source)
    return LoadedModel(model.eval(), checkpoint.tokenizer, False, time.perf_counter() - start, checkpoint.format)


def describe(loaded: LoadedModel, spec: ModelSpec) -> str:
    config = loaded.model.config
    source = f"RANDOM weights (seed {spec.seed})" if loaded.random_weights else f"{loaded.format.upper()} weights"
    return (f"{Path(spec.label).name}: {config.n_params() / 1e6:.1f}M params, layout {config.layout_name}, "
            f"tp={loaded.model.comm.world_size}, {source}, loaded in {loaded.load_s:.1f} s")
