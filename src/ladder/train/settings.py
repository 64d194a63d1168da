"""`ladder train`'s settings: a dataclass read from YAML or TOML and `key=value` overrides, every
key known and every value checked before a worker starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ladder.errors import LadderError
from ladder.quant.quantize import QUANTIZE_MODES


@dataclass
class TrainConfig:
    """Everything a run needs. Load from YAML/TOML (`load_train_config`), override with `key=value`."""

    # model: a preset trained from scratch, or a checkpoint adapted
    preset: str | None = "tiny"
    model: str | None = None  # checkpoint (path or short name); wins over preset
    layout: str | None = None
    ladder_layers: int | None = None
    trainable: str = "all"  # all, converted (only the ladder layers), or lora (PEFT adapters)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_layers: str = "converted"  # which layers get adapters: converted (the ladder layers) or all
    desync_reduce: str | None = None  # desync layout: which modules all-reduce (default: the MLPs)
    desync_tp: int | None = None  # desync layout: the TP degree to train for, ranks simulated (default: 2)
    # data
    data: list[str] = field(default_factory=lambda: ["shakespeare:train"])
    data_weights: list[float] | None = None  # each batch draws from the data sources in these proportions
    heldout: list[str] = field(default_factory=lambda: ["shakespeare:heldout"])
    answers_max_tokens: int = 192  # answers:PROMPTS data: the longest answer the teacher writes
    answers_temperature: float = 0.7  # ...sampled at this temperature (0: greedy), seeded by seed
    # distillation (docs/training.md): the model learns the teacher's outputs
    teacher: str | None = None  # original (the model before conversion), a checkpoint, or none
    temperature: float = 1.0  # of the KL on logits, which is scaled by temperature^2
    kl_weight: float = 1.0
    hidden_weight: float = 0.0  # matching of the residual stream after each converted layer
    ce_weight: float | None = None  # cross-entropy on the text; default 1 without a teacher, 0 with one
    calibrate_tokens: int = 0  # before step 0, fit each converted module's stale input to the teacher's on
    # this many training tokens, in closed form (ladder.train.calibrate); 0: off
    seq_len: int = 128
    # optimisation
    steps: int = 200
    batch_size: int = 16  # sequences per optimizer step (global, over all ranks)
    micro_batch_size: int = 8  # sequences per forward on one rank (gradient accumulation makes up the rest)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or fp32 / bf16 (a CPU with bf16 arithmetic)
    parallel: str = "ddp"  # ddp or fsdp (used when the world size is > 1)
    # bookkeeping
    out_dir: str = "runs/train"
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 50
    eval_batches: int = 8
    eval_quantize: str | None = None  # int8 or int4: also report the held-out loss of a quantized copy
    device: str = "auto"
    stop_at: int | None = None  # stop after this step as if interrupted (time-boxed jobs; resume continues)

    def validate(self) -> None:
        if self.seq_len < 2:
            raise LadderError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.steps < (0 if self.calibrate_tokens else 1) or self.batch_size < 1 or self.micro_batch_size < 1:
            raise LadderError("steps, batch_size and micro_batch_size must be >= 1 (steps=0 with calibrate_tokens: "
                              "calibrate only)")
        if self.parallel not in ("ddp", "fsdp"):
            raise LadderError(f"parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise LadderError(f"precision must be auto, fp32 or bf16, got {self.precision!r}")
        if self.eval_quantize is not None and self.eval_quantize not in QUANTIZE_MODES:
            raise LadderError(f"eval_quantize must be one of {', '.join(QUANTIZE_MODES)} or none, got {self.eval_quantize!r}")
        if self.eval_quantize is not None and self.parallel == "fsdp":
            raise LadderError("eval_quantize quantizes a copy of the whole model, and fsdp shards it: use parallel=ddp")
        if not self.data:
            raise LadderError("no training data: set data to text files, folders or shakespeare:train")
        for name in ("lr", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batches"):
            if not getattr(self, name) > 0:  # `not >` also refuses nan
                raise LadderError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_lr", "warmup_steps", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise LadderError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise LadderError(f"min_lr {self.min_lr:g} is above lr {self.lr:g}: the schedule decays from lr to min_lr")
        if self.trainable not in TRAINABLE:
            raise LadderError(f"trainable must be one of {', '.join(TRAINABLE)}, got {self.trainable!r}")
        if self.lora_layers not in ("converted", "all"):
            raise LadderError(f"lora_layers must be converted or all, got {self.lora_layers!r}")
        if self.lora_rank < 1 or not self.lora_alpha > 0:
            raise LadderError(f"lora_rank must be >= 1 and lora_alpha > 0, got {self.lora_rank} and {self.lora_alpha}")
        if self.data_weights is not None:
            if len(self.data_weights) != len(self.data):
                raise LadderError(f"data_weights has {len(self.data_weights)} weights for {len(self.data)} data sources")
            if not all(w >= 0 for w in self.data_weights) or not sum(self.data_weights) > 0:
                raise LadderError(f"data_weights must be >= 0 and not all 0, got {self.data_weights}")
        if self.answers_max_tokens < 1 or not self.answers_temperature >= 0:
            raise LadderError("answers_max_tokens must be >= 1 and answers_temperature >= 0")
        if not self.temperature > 0:
            raise LadderError(f"temperature must be > 0, got {self.temperature}")
        for name in ("kl_weight", "hidden_weight"):
            if not getattr(self, name) >= 0:
                raise LadderError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ce_weight is not None and not self.ce_weight >= 0:
            raise LadderError(f"ce_weight must be >= 0, got {self.ce_weight}")
        if self.teacher is None and (self.hidden_weight or self.ce_weight == 0 or self.calibrate_tokens):
            raise LadderError("hidden_weight, calibrate_tokens and ce_weight=0 need a teacher: set teacher=original "
                              "or a checkpoint")
        if self.calibrate_tokens < 0:
            raise LadderError(f"calibrate_tokens must be >= 0, got {self.calibrate_tokens}")
        if self.loss_weights()["kl"] + self.loss_weights()["hidden"] + self.loss_weights()["ce"] == 0:
            raise LadderError("every loss weight is 0: nothing to train")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise LadderError(f"{name} must be in [0, 1), got {getattr(self, name)}")


    def loss_weights(self) -> dict[str, float]:
        """The weight of each loss term: KL to the teacher's logits, residual matching, cross-entropy."""
        if self.teacher is None:
            return {"kl": 0.0, "hidden": 0.0, "ce": 1.0 if self.ce_weight is None else self.ce_weight}
        return {"kl": self.kl_weight, "hidden": self.hidden_weight,
                "ce": 0.0 if self.ce_weight is None else self.ce_weight}


TRAINABLE = ("all", "converted", "lora")


def settings_help() -> str:
    """`ladder train --help`'s list of the settings, each as an override with its default value."""
    def spelled(value: Any) -> str:  # as it would be written on the command line
        if isinstance(value, list):
            return ",".join(str(v) for v in value)
        return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    defaults = TrainConfig()
    return "settings (KEY=VALUE, or keys of the --config file) and their defaults: " + ", ".join(
        f"{f.name}={spelled(getattr(defaults, f.name))}" for f in dataclasses.fields(TrainConfig)) + "."


def _coerce(name: str, value: Any, current: Any) -> Any:
    kind = {f.name: f.type for f in dataclasses.fields(TrainConfig)}[name]
    if isinstance(value, str) and "list[float]" in str(kind):
        if value.lower() in ("none", "null"):
            return None
        try:
            return [float(v) for v in value.split(",") if v]
        except ValueError:
            raise LadderError(f"{name} expects comma-separated numbers, got {value!r}") from None
    if isinstance(value, str) and "list" in str(kind):
        return [] if value.lower() in ("none", "null") else [v for v in value.split(",") if v]
    if isinstance(value, str):
        if value.lower() in ("none", "null") and "None" in str(kind):
            return None
        if "bool" in str(kind):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise LadderError(f"{name} expects true or false, got {value!r}")
            return value.lower() in ("true", "1", "yes")
        if "int" in str(kind):
            try:
                return int(value)
            except ValueError:
                raise LadderError(f"{name} expects an integer, got {value!r}") from None
        if "float" in str(kind):
            try:
                return float(value)
            except ValueError:
                raise LadderError(f"{name} expects a number, got {value!r}") from None
    return value


def _toml() -> Any:
    """The standard library's TOML reader (Python 3.11+), or the same one as the tomli package on 3.10."""
    try:
        import tomllib
        return tomllib
    except ImportError:
        try:
            import tomli
            return tomli
        except ImportError:
            raise LadderError("reading TOML on Python 3.10 needs tomli: pip install tomli (or use YAML)") from None


def load_train_config(path: str | None, overrides: list[str]) -> TrainConfig:
    """A config file (YAML or TOML), then `key=value` overrides; unknown keys are errors."""
    values: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise LadderError(f"no config file at {path}")
        toml = _toml() if p.suffix == ".toml" else None  # (outside the try: its error is not a parse error)
        try:
            if toml is not None:
                values = toml.loads(p.read_text())
            else:
                values = yaml.safe_load(p.read_text()) or {}
        except Exception as exc:
            raise LadderError(f"{path} is not valid {'TOML' if p.suffix == '.toml' else 'YAML'} ({exc})") from None
        if not isinstance(values, dict):
            raise LadderError(f"{path} must hold a mapping of config keys")
    for item in overrides:
        if "=" not in item:
            raise LadderError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        values[key.strip().replace("-", "_")] = value
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise LadderError(f"unknown config key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
    config = TrainConfig()
    for key, value in values.items():
        setattr(config, key, _coerce(key, value, getattr(config, key)))
    config.validate()
    return config
