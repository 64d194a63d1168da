"""`ladder train`: pretraining from a preset, or adaptation of a checkpoint converted to ladder.

Data parallel on an existing engine: PyTorch DDP or FSDP2 (`fully_shard`) under torchrun or `--nproc`,
gloo on CPU. Every rank takes its own slice of each global batch; the loss is the mean over the global
batch, so a run at world size 2 follows the same curve as world size 1 with the same global batch.

Never loses work: a checkpoint (weights in Hugging Face format, optimizer, scheduler position, data
position, RNG states) every `checkpoint_every` steps and on Ctrl-C, written to a temporary folder and
renamed into place; `--resume` continues from the newest one and reproduces the uninterrupted run.
Each checkpoint folder is a model folder that `ladder generate / eval / convert` accept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ladder.distributed import check_ranks_agree, fingerprint, from_every_rank
from ladder.errors import LadderError, Stopped


@dataclass
class TrainConfig:
    """Everything a run needs. Load from YAML/TOML (`load_train_config`), override with `key=value`."""

    # model: a preset trained from scratch, or a checkpoint adapted
    preset: str | None = "tiny"
    model: str | None = None  # checkpoint (path or short name); wins over preset
    layout: str | None = None
    ladder_layers: int | None = None
    train_only_ladder_layers: bool = False  # adaptation: freeze everything but the converted layers
    desync_reduce: str | None = None  # desync layout: which modules all-reduce (default: the MLPs)
    desync_tp: int | None = None  # desync layout: the TP degree to train for, ranks simulated (default: 2)
    # data
    data: list[str] = field(default_factory=lambda: ["shakespeare:train"])
    heldout: list[str] = field(default_factory=lambda: ["shakespeare:heldout"])
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
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or fp32 / bf16
    parallel: str = "ddp"  # ddp or fsdp (used when the world size is > 1)
    # bookkeeping
    out_dir: str = "runs/train"
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 50
    eval_batches: int = 8
    device: str = "auto"
    stop_at: int | None = None  # stop after this step as if interrupted (time-boxed jobs; resume continues)

    def validate(self) -> None:
        if self.seq_len < 2:
            raise LadderError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.steps < 1 or self.batch_size < 1 or self.micro_batch_size < 1:
            raise LadderError("steps, batch_size and micro_batch_size must be >= 1")
        if self.parallel not in ("ddp", "fsdp"):
            raise LadderError(f"parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise LadderError(f"precision must be auto, fp32 or bf16, got {self.precision!r}")
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
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise LadderError(f"{name} must be in [0, 1), got {getattr(self, name)}")


def settings_help() -> str:
    """`ladder train --help`'s list of the settings, each as an override with its default value."""
    def spelled(value: Any) -> str:  # as it would be written on the command line
        if isinstance(value, list):
            return ",".join(value)
        return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    defaults = TrainConfig()
    return "settings (KEY=VALUE, or keys of the --config file) and their defaults: " + ", ".join(
        f"{f.name}={spelled(getattr(defaults, f.name))}" for f in dataclasses.fields(TrainConfig)) + "."


def _coerce(name: str, value: Any, current: Any) -> Any:
    kind = {f.name: f.type for f in dataclasses.fields(TrainConfig)}[name]
    if isinstance(value, str) and "list" in str(kind):
        return [v for v in value.split(",") if v]
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
                import yaml
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


# ---- data -----------------------------------------------------------------------------------------

def read_texts(specs: list[str]) -> list[str]:
    """Texts from files, folders (every *.txt inside) or `shakespeare:train|heldout`."""
    from ladder.corpora import python_docs_text, shakespeare_text

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


# ---- schedule -------------------------------------------------------------------------------------

def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


# ---- checkpoints ----------------------------------------------------------------------------------

def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a temporary folder is never complete)."""
    root = out_dir / "checkpoints"
    return sorted((p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()),
                  key=lambda p: int(p.name.split("-")[1])) if root.is_dir() else []


def save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    config: TrainConfig, tokenizer: Any, rank: int = 0, world: int = 1) -> Path:
    """Write step-N atomically; every rank calls this. Full weights are gathered on every rank (FSDP
    shards them), each rank adds its own optimizer and RNG state, and rank 0 renames the temporary
    folder into place once all are written, then keeps only the newest `keep_checkpoints`."""
    from safetensors.torch import save_file

    from ladder.checkpoint import config_to_hf
    from ladder.weights import export_hf_state_dict

    root = out_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    full = _full_parameters(model)  # a collective under FSDP: all ranks, same order
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(world)
    try:
        torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state(), "world_size": world},
                   tmp / f"optimizer-rank{rank}.pt")
        if rank == 0:
            (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
            save_file(export_hf_state_dict(model, full), str(tmp / "model.safetensors"), metadata={"format": "pt"})
            if tokenizer is not None:
                tokenizer.save_hf(tmp)
            (tmp / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
        _barrier(world)
        if rank == 0:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "world_size": world}) + "\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in checkpoint_dirs(out_dir)[:-config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(world)
    return final


def check_out_dir_is_shared(out_dir: Path, rank: int, world: int) -> None:
    """Every rank writes its part of each checkpoint into out_dir, and reads it back on --resume: on
    several machines out_dir must be one folder they all share. Found out before training starts, not
    at the first checkpoint, hours in."""
    if world == 1:
        return
    import socket
    import uuid

    import torch.distributed as dist

    name = [f".ladder-shared-{uuid.uuid4().hex}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    marker = out_dir / name[0]
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(name[0])
    dist.barrier()
    try:
        sees = marker.read_text() == name[0]
    except OSError:
        sees = False
    everyone: list[Any] = from_every_rank((sees, socket.gethostname()))  # (after every rank's read)
    if rank == 0:
        marker.unlink()
    blind = next((r for r, (saw, _) in enumerate(everyone) if not saw), None)
    if blind is not None:
        raise LadderError(f"out_dir {out_dir} is not one folder for every rank: rank {blind} (on "
                          f"{everyone[blind][1]}) does not see what rank 0 wrote there; put it on a filesystem "
                          "every node shares")


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def _full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor (FSDP2 keeps DTensor shards: gather them)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters(remove_duplicate=False)}


# ---- the loop -------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    losses: list[float]
    final_dir: Path
    eval_loss: float | None


def _autocast(config: TrainConfig, device: torch.device):
    use_bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    import contextlib
    return contextlib.nullcontext()


def _build(config: TrainConfig, device: torch.device) -> tuple[Any, Any]:
    """The model (TP=1, fp32 master weights) and its tokenizer."""
    from ladder.checkpoint import open_checkpoint, with_layout
    from ladder.config import get_preset
    from ladder.distributed import LocalCommunicator
    from ladder.tokenizer import TextTokenizer
    from ladder.weights import DictSource, build_model, init_hf_state_dict, load_weights

    if config.model:
        checkpoint = open_checkpoint(config.model)
        if checkpoint.tokenizer is None:
            raise LadderError(f"{config.model} has no tokenizer to read the training text with")
        model_config = _with_desync_tp(with_layout(checkpoint.config, config.layout, config.ladder_layers,
                                                   config.desync_reduce), config)
        model = build_model(model_config, LocalCommunicator(), device)
        load_weights(model, checkpoint.source)
        return model, checkpoint.tokenizer
    changes: dict[str, Any] = {}
    if config.layout is not None or config.ladder_layers is not None:
        changes = {"layout": config.layout or "ladder", "ladder_layers": config.ladder_layers}
    if config.desync_reduce is not None:
        changes["desync_reduce"] = config.desync_reduce
    model_config = _with_desync_tp(get_preset(config.preset or "tiny", **changes), config)  # from scratch: any layout
    tokenizer = TextTokenizer.bytes()
    if model_config.vocab_size != tokenizer.vocab_size:
        raise LadderError(f"preset {config.preset} has vocab_size {model_config.vocab_size}; training from scratch "
                          f"uses a byte tokenizer (256): pick a preset with vocab_size 256, such as tiny")
    model = build_model(model_config, LocalCommunicator(), device)
    load_weights(model, DictSource(init_hf_state_dict(model_config, config.seed)))
    return model, tokenizer


def _with_desync_tp(model_config: Any, config: TrainConfig) -> Any:
    """A desync model is trained for one TP degree (its ranks simulated); record which in its config."""
    if model_config.layout == "upper-bound":
        raise LadderError("the upper-bound layout never re-synchronises its ranks: a speed ceiling, not a model "
                          "to train (train desync instead)")
    if model_config.layout != "desync":
        if config.desync_tp is not None:
            raise LadderError(f"desync_tp is set ({config.desync_tp}) but the layout is {model_config.layout!r}")
        return model_config
    tp = config.desync_tp or model_config.desync_tp or 2
    model_config.check_tp(tp)
    return model_config.replace(desync_tp=tp)


def freeze_non_ladder(model: Any) -> int:
    """Train only the ladder layers (adaptation); returns the number of trainable parameters."""
    n_ladder = model.config.n_ladder_layers
    if n_ladder == 0:
        raise LadderError("train_only_ladder_layers needs a ladder conversion (set ladder_layers)")
    first = model.config.n_layers - n_ladder
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("layers.") and int(name.split(".")[1]) >= first
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> TrainResult:
    """Run (or continue) training on this rank; world size and rank come from the environment."""
    from ladder.distributed import init_distributed, shutdown_distributed
    import torch.distributed as dist

    config.validate()  # configs built in Python skip load_train_config
    ctx = init_distributed(config.device)
    try:
        return _train(config, resume, progress, ctx, dist)
    finally:
        shutdown_distributed()


def _train(config: TrainConfig, resume: bool, progress: bool, ctx: Any, dist: Any) -> TrainResult:
    from tqdm import tqdm

    out_dir = Path(config.out_dir)
    world, rank = ctx.world_size, ctx.rank
    if config.batch_size % (world * config.micro_batch_size):
        raise LadderError(f"batch_size {config.batch_size} must be a multiple of world size {world} x "
                          f"micro_batch_size {config.micro_batch_size}")
    accumulation = config.batch_size // (world * config.micro_batch_size)
    check_out_dir_is_shared(out_dir, rank, world)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model, tokenizer = _build(config, ctx.device)
    if config.seq_len > model.config.max_seq_len:
        raise LadderError(f"seq_len {config.seq_len} exceeds the model's context (max_seq_len "
                          f"{model.config.max_seq_len})")
    if config.train_only_ladder_layers:
        freeze_non_ladder(model)
    train_batches = Batches(pack(read_texts(config.data), tokenizer, config.seq_len), config.batch_size, config.seed)
    heldout = pack(read_texts(config.heldout), tokenizer, config.seq_len) if config.heldout else None
    # Ranks with other settings (under torchrun each node has its own command line) would apply one
    # averaged gradient differently, and their replicas drift apart without an error.
    check_ranks_agree((dataclasses.asdict(config), resume, fingerprint(train_batches.sequences), fingerprint(heldout)),
                      "training settings or data")

    latest = None
    if resume:
        latest = _latest_checkpoint(out_dir, model)  # weights load before FSDP shards them
    elif checkpoint_dirs(out_dir):
        raise LadderError(f"{out_dir} already holds checkpoints: pass --resume to continue, or choose another out_dir")

    core = model  # the Transformer: what checkpoints save
    net = _simulated_ranks_if_desync(model, config, world)  # what computes the loss, before data parallelism
    model = _data_parallel(net, config, world)
    optimizer, trainable = _adamw(model, config)

    start_step = _resume_optimizer(latest, optimizer, rank, world) if latest else 0

    metrics_path = out_dir / "metrics.jsonl"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    losses: list[float] = []
    eval_loss = None
    tokens_per_step = config.batch_size * config.seq_len
    bar = tqdm(range(start_step, config.steps), initial=start_step, total=config.steps, desc="train",
               disable=not (progress and rank == 0), dynamic_ncols=True)
    stop = _StopRequest()
    try:
        for step in bar:
            t0 = time.perf_counter()
            lr = learning_rate(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            local = train_batches.global_batch(step)[rank::world]  # this rank's shard of the global batch
            loss_sum = _accumulate_gradients(model, local, config, accumulation, ctx.device)
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            agreed = torch.stack([loss_sum, torch.tensor(float(stop.signum > 0), device=ctx.device)])
            if world > 1:
                dist.all_reduce(agreed)  # the mean loss, and whether any rank was asked to stop
            loss_value, stopping_now = float(agreed[0] / world), bool(agreed[1] > 0)
            if not math.isfinite(loss_value):
                raise LadderError(f"the loss became {loss_value} at step {step}: lower lr (now {lr:g})")
            losses.append(loss_value)
            record: dict[str, Any] = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                                      "tokens": (step + 1) * tokens_per_step,
                                      "tokens_per_s": tokens_per_step / (time.perf_counter() - t0)}
            if heldout is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
                eval_loss = evaluate_loss(net, heldout, config, ctx)
                record.update(eval_loss=eval_loss, eval_ppl=math.exp(eval_loss))
            if rank == 0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if step + 1 < config.steps:  # the last step is saved after the loop
                stopping = config.stop_at is not None and step + 1 >= config.stop_at
                if stopping or stopping_now or (step + 1) % config.checkpoint_every == 0:
                    saved = save_checkpoint(out_dir, step + 1, core, optimizer, config, tokenizer, rank, world)
                    if stopping_now:
                        stop.raise_stop(f"saved step {step + 1} to {out_dir / 'checkpoints'}; continue with --resume")
                    if stopping:
                        return TrainResult(losses, saved, eval_loss)
    finally:
        stop.restore()
    if eval_loss is None and heldout is not None:  # e.g. resumed a run that had already finished
        eval_loss = evaluate_loss(net, heldout, config, ctx)
    final = save_checkpoint(out_dir, config.steps, core, optimizer, config, tokenizer, rank, world)
    return TrainResult(losses, final, eval_loss)


def _simulated_ranks_if_desync(model: Any, config: TrainConfig, world: int) -> Any:
    """Desync trains every simulated TP rank inside each process (`ladder.simulate`); other layouts as is."""
    if model.config.layout != "desync":
        return model
    from ladder.simulate import SimulatedRanks
    if world > 1 and config.parallel == "fsdp":
        raise LadderError("desync training simulates its ranks inside each process, which FSDP cannot shard: "
                          "use parallel=ddp")
    return SimulatedRanks(model, model.config.desync_tp)


def _data_parallel(model: Any, config: TrainConfig, world: int) -> Any:
    """Wrap the model for data parallelism over `world` ranks (FSDP2 or DDP); alone, unchanged."""
    if world == 1:
        return model
    if config.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard
        # FSDP2 gathers parameters in a module's forward hooks; the layout loop calls the attention
        # and MLP modules (not Block.forward), so those are the units; norms and embeddings go to the root.
        for layer in model.layers:
            fully_shard(layer.attention)
            fully_shard(layer.feed_forward)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model)


def _adamw(model: Any, config: TrainConfig) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW over the trainable parameters, without weight decay on gains and biases (1-D)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, betas=(config.beta1, config.beta2), foreach=False)
    return optimizer, trainable


def _accumulate_gradients(model: Any, local: torch.Tensor, config: TrainConfig, accumulation: int,
                          device: torch.device) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches; returns their summed loss (already divided by
    the accumulation steps, so the sum over ranks / world is the global batch's mean loss)."""
    loss_sum = torch.zeros((), device=device)
    model.train()
    for micro in local.split(config.micro_batch_size):  # (micro_batch_size, seq_len + 1) token ids
        micro = micro.to(device)
        with _autocast(config, device):
            logits = model(micro[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), micro[:, 1:].flatten()) / accumulation
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


class _StopRequest:
    """Ctrl-C and SIGTERM (a scheduler's pre-emption) ask training to stop at the end of the current step,
    where every rank agrees on it and saves the same step: a rank stopped mid-step would leave the
    others waiting in a collective. Later signals (pressed again, or the launcher passing the first on
    to its workers) are ignored, so the checkpoint is not cut short."""

    def __init__(self) -> None:
        self.signum = 0
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._request) for s in (signal.SIGINT, signal.SIGTERM)}

    def _request(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def raise_stop(self, said: str) -> None:
        if self.signum in (0, signal.SIGINT):
            raise KeyboardInterrupt(said)
        raise Stopped(self.signum, said)


def _latest_checkpoint(out_dir: Path, model: Any) -> Path:
    found = checkpoint_dirs(out_dir)
    if not found:
        raise LadderError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
    from ladder.checkpoint import open_hf
    from ladder.weights import load_weights

    checkpoint = open_hf(found[-1])
    if checkpoint.config.canonical() != model.config.canonical():
        raise LadderError(f"{found[-1]} holds a model of another shape or layout than this config builds")
    load_weights(model, checkpoint.source)
    return found[-1]


def _resume_optimizer(latest: Path, optimizer: Any, rank: int, world: int) -> int:
    state_file = latest / f"optimizer-rank{rank}.pt"
    saved_world = json.loads((latest / "trainer_state.json").read_text()).get("world_size", 1)
    if saved_world != world or not state_file.is_file():
        raise LadderError(f"{latest} was written by {saved_world} ranks; resume it with the same world size "
                          f"(now {world})")
    state = torch.load(state_file, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    return int(json.loads((latest / "trainer_state.json").read_text())["step"])


@torch.no_grad()
def evaluate_loss(model: Any, heldout: torch.Tensor, config: TrainConfig, ctx: Any) -> float:
    """Mean token loss on the first `eval_batches` held-out micro-batches (the same ones every time)."""
    model.eval()
    total, count = 0.0, 0
    for micro in heldout[: config.eval_batches * config.micro_batch_size].split(config.micro_batch_size):
        micro = micro.to(ctx.device)
        logits = model(micro[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten(), reduction="sum").item()
        count += micro[:, 1:].numel()
    model.train()
    return total / count
