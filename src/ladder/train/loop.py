"""`ladder train`: pretraining from a preset, or adaptation of a checkpoint converted to ladder, by
cross-entropy on text or by distillation from a teacher (`ladder.train.distill`).

Data parallel on an existing engine: PyTorch DDP or FSDP2 (`fully_shard`) under torchrun or `--nproc`,
gloo on CPU. Every rank takes its own slice of each global batch; the loss is the mean over the global
batch, so a run at world size 2 follows the same curve as world size 1 with the same global batch.

Never loses work: a checkpoint (`ladder.train.checkpoints`) every `checkpoint_every` steps and on
Ctrl-C or SIGTERM; `--resume` continues from the newest one and reproduces the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import dataclasses
import gc
import json
import math
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.comm.distributed import DistContext, check_ranks_agree, fingerprint, init_distributed, shutdown_distributed
from ladder.comm.launch import under_torchrun
from ladder.console import is_rank0, say
from ladder.errors import LadderError, Stopped
from ladder.files import append_line, write_text
from ladder.model.config import cpu_computes_in_bf16
from ladder.model.spec import ModelSpec
from ladder.model.transformer import Transformer
from ladder.quant.quantize import quantize_shard
from ladder.train.checkpoints import (check_out_dir_is_shared, checkpoint_dirs, load_latest_checkpoint,
                                      resume_optimizer, save_checkpoint)
from ladder.train.answers import answer_texts, is_answers
from ladder.train.calibrate import calibrate_stale_inputs, describe
from ladder.train.data import Batches, pack, read_texts
from ladder.train.distill import ORIGINAL, Objective, load_teacher, teacher_spec
from ladder.train.lora import add_lora
from ladder.train.settings import TrainConfig
from ladder.train.simulate import SimulatedRanks


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainResult:
    losses: list[float]
    final_dir: Path
    eval_loss: float | None


def _computes_in_bf16(config: TrainConfig, device: torch.device) -> bool:
    """bf16 autocast: asked for, or `auto` on CUDA. `auto` keeps a CPU run in fp32 on every CPU, so that a run
    gives the same losses on either kind of CPU (the suite's golden losses); bf16 is for a CPU with bf16
    arithmetic."""
    return config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")


def _warn_of_emulated_bf16(config: TrainConfig, device: torch.device) -> None:
    """SmolLM2's distillation on a 2-core AVX2 EPYC: 4 tokens/s in bf16 against 81 in fp32 (docs/training.md)."""
    if config.precision == "bf16" and device.type == "cpu" and not cpu_computes_in_bf16() and is_rank0():
        say("ladder: precision=bf16 on a CPU without bf16 arithmetic (AVX2) is emulated, about 20x slower than "
            "fp32 (precision=auto)")


def _autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16) if _computes_in_bf16(config, device) else \
        contextlib.nullcontext()


def model_spec(config: TrainConfig) -> ModelSpec:
    """The model a run trains (TP 1, float32 master weights); a desync model records the TP degree it is
    trained for, its ranks simulated (default 2). Random weights are the documented initialisation."""
    spec = ModelSpec(preset=config.preset or "tiny", model=config.model, layout=config.layout,
                     ladder_layers=config.ladder_layers, desync_reduce=config.desync_reduce, device=config.device,
                     dtype="float32", seed=config.seed)
    config_before = spec.config()
    layout = config_before.layout
    if layout == "upper-bound":
        raise LadderError("the upper-bound layout never re-synchronises its ranks: a speed ceiling, not a model "
                          "to train (train desync instead)")
    if layout != "desync":
        if config.desync_tp is not None:
            raise LadderError(f"desync_tp is set ({config.desync_tp}) but the layout is {layout!r}")
        return spec
    tp = config.desync_tp or config_before.desync_tp or 2
    config_before.check_tp(tp)
    return spec.replace(desync_tp=tp)


def _build(config: TrainConfig, device: torch.device) -> tuple[Transformer, TextTokenizer]:
    """The model and the tokenizer that reads its text (a checkpoint's own, or bytes from scratch)."""
    spec = model_spec(config)
    if config.model:
        loaded = spec.load(LocalCommunicator(), device, simulated_ranks=True)
        if loaded.tokenizer is None:
            raise LadderError(f"{config.model} has no tokenizer to read the training text with")
        return loaded.model, loaded.tokenizer
    tokenizer = TextTokenizer.bytes()
    vocab = spec.config().vocab_size
    if vocab != tokenizer.vocab_size:
        raise LadderError(f"preset {config.preset} has vocab_size {vocab}; training from scratch "
                          f"uses a byte tokenizer (256): pick a preset with vocab_size 256, such as tiny")
    return spec.load(LocalCommunicator(), device, simulated_ranks=True).model, tokenizer


def converted_layers(model: Any) -> list[int]:
    """The layers a ladder conversion changed (the last n_ladder_layers)."""
    return list(range(model.config.first_ladder_layer, model.config.n_layers))


def freeze_non_ladder(model: Any) -> int:
    """Train only the ladder layers (adaptation); returns the number of trainable parameters."""
    layers = converted_layers(model)
    if not layers:
        raise LadderError("trainable=converted needs a ladder conversion (set ladder_layers)")
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("layers.") and int(name.split(".")[1]) >= layers[0]
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def shares_frozen_prefix(config: TrainConfig, model: Transformer) -> bool:
    """Whether the student's layers before its ladder layers are the teacher's, frozen: the checkpoint it
    was converted from as teacher, and only the converted layers training."""
    return (config.teacher == ORIGINAL and config.trainable == "converted" and model.config.layout == "ladder"
            and model.config.first_ladder_layer > 0)


def choose_trainable(model: Any, config: TrainConfig) -> None:
    """Which parameters train: all, the converted layers', or LoRA adapters (on the converted layers or all)."""
    if config.trainable == "converted":
        freeze_non_ladder(model)
    elif config.trainable == "lora":
        layers = converted_layers(model) if config.lora_layers == "converted" else list(range(model.config.n_layers))
        add_lora(model, layers, config.lora_rank, config.lora_alpha)


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> TrainResult:
    """Run (or continue) training on this rank; world size and rank come from the environment."""
    config.validate()  # configs built in Python skip load_train_config
    ctx = init_distributed(config.device)
    run = None
    try:
        run = _Run(config, ctx, resume)
        return run.loop(progress)
    finally:
        # DDP's reducer holds the process group: freed after the group was destroyed, it was the group's last
        # owner and joined gloo's threads in its destructor (see shutdown_distributed). Free it first.
        del run
        gc.collect()
        shutdown_distributed()


class _Run:
    """One rank's training run: its model (and what wraps it), optimizer and data, set up in order."""

    def __init__(self, config: TrainConfig, ctx: DistContext, resume: bool) -> None:
        self.config, self.ctx, self.out_dir = config, ctx, Path(config.out_dir)
        world, rank = ctx.world_size, ctx.rank
        if config.batch_size % (world * config.micro_batch_size):
            raise LadderError(f"batch_size {config.batch_size} must be a multiple of world size {world} x "
                              f"micro_batch_size {config.micro_batch_size}")
        self.accumulation = config.batch_size // (world * config.micro_batch_size)
        check_out_dir_is_shared(self.out_dir, rank, world)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        _warn_of_emulated_bf16(config, ctx.device)
        model, self.tokenizer = _build(config, ctx.device)
        if config.seq_len > model.config.max_seq_len:
            raise LadderError(f"seq_len {config.seq_len} exceeds the model's context (max_seq_len "
                              f"{model.config.max_seq_len})")
        self.teacher, self.run_state = None, {}
        if config.teacher is not None:  # in float32 until calibrated (below)
            spec = teacher_spec(config.teacher, config.model, config.device)
            self.teacher, identity = load_teacher(spec, ctx.device, model, self.tokenizer)
            self.run_state = {"teacher": identity}
        if not resume and checkpoint_dirs(self.out_dir):
            raise LadderError(f"{self.out_dir} already holds checkpoints: pass --resume to continue, or choose "
                              "another out_dir")
        self.batches = Batches([self._sequences(spec) for spec in config.data], config.batch_size, config.seed,
                               config.data_weights)
        self.heldout = pack(read_texts(config.heldout), self.tokenizer, config.seq_len) if config.heldout else None
        # Ranks with other settings (under torchrun each node has its own command line) would apply one
        # averaged gradient differently, and their replicas drift apart without an error.
        check_ranks_agree((dataclasses.asdict(config), resume, fingerprint(self.batches.sequences),
                           fingerprint(self.heldout), self.run_state), "training settings, data or teacher")
        if config.calibrate_tokens and (not resume or config.trainable == "lora"):  # (adapters' checkpoints
            self._calibrate(model)  # hold no base weights: those are calibrated again, as they were)
        choose_trainable(model, config)
        if self.teacher is not None and _computes_in_bf16(config, ctx.device):
            self.teacher = self.teacher.to(torch.bfloat16)  # autocast would cast its weights at every forward
        latest = None
        if resume:  # weights load before FSDP shards them
            latest = load_latest_checkpoint(self.out_dir, model, self.run_state, rank)
        self.objective = Objective(config.loss_weights(), config.temperature, model, self.teacher,
                                   share_prefix=shares_frozen_prefix(config, model))
        self.core = model  # the Transformer: what checkpoints save
        self.net = _simulated_ranks_if_desync(model, config, world)  # what computes the loss, before DP
        self.model = _data_parallel(self.net, config, world)
        self.optimizer, self.trainable = _adamw(self.model, config)
        self.start_step = resume_optimizer(latest, self.optimizer, rank, world) if latest else 0
        self.losses: list[float] = []
        self.eval_loss: float | None = None

    def _calibrate(self, model: Transformer) -> None:
        """`ladder.train.calibrate` on the run's first training tokens (every rank the same: the result is too)."""
        config = self.config
        rows = math.ceil(config.calibrate_tokens / config.seq_len)
        steps = range(math.ceil(rows / config.batch_size))
        tokens = torch.cat([self.batches.global_batch(step) for step in steps])[:rows, :-1].to(self.ctx.device)
        start = time.perf_counter()
        fits = calibrate_stale_inputs(model, self.teacher, tokens)
        if self.ctx.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            say(f"ladder: {describe(fits)}, on {tokens.numel():,} tokens in {time.perf_counter() - start:.0f} s")
            write_text(self.out_dir / "calibration.json", json.dumps(
                {"tokens": tokens.numel(), "seconds": time.perf_counter() - start,
                 "modules": [dataclasses.asdict(f) for f in fits]}, indent=1) + "\n")

    def _sequences(self, source: str) -> torch.Tensor:
        """One data source as packed sequences: text, or the teacher's answers to prompts (written first)."""
        config, ctx = self.config, self.ctx
        if not is_answers(source):
            return pack(read_texts([source]), self.tokenizer, config.seq_len)
        # The teacher writes them; without one, the model as it was before conversion.
        writer = teacher_spec(config.teacher or "original", config.model, config.device)
        texts = answer_texts(source, writer, self.run_state.get("teacher", writer.label), self.tokenizer, self.out_dir, config.answers_max_tokens,
                             config.answers_temperature, config.seed, ctx.device, ctx.rank, ctx.world_size)
        return pack(texts, self.tokenizer, config.seq_len)

    def loop(self, progress: bool) -> TrainResult:
        config, rank = self.config, self.ctx.rank
        if rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        bar = tqdm(range(self.start_step, config.steps), initial=self.start_step, total=config.steps, desc="train",
                   disable=not (progress and rank == 0), dynamic_ncols=True)
        stop = _StopRequest()
        try:
            for step in bar:
                record, stopping_now = self.step(step, stop)
                if rank == 0:
                    append_line(self.out_dir / "metrics.jsonl", json.dumps(record))
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if step + 1 < config.steps:  # the last step is saved after the loop
                    stopping = config.stop_at is not None and step + 1 >= config.stop_at
                    if stopping or stopping_now or (step + 1) % config.checkpoint_every == 0:
                        saved = self.save(step + 1)
                        if stopping_now:
                            stop.raise_stop(f"saved step {step + 1} to {self.out_dir / 'checkpoints'}; continue "
                                            "with --resume")
                        if stopping:
                            return TrainResult(self.losses, saved, self.eval_loss)
        finally:
            stop.restore()
        if self.eval_loss is None and self.heldout is not None:  # e.g. resumed a run that had already finished
            self.eval_loss = evaluate_loss(self.net, self.heldout, config, self.ctx)
        return TrainResult(self.losses, self.save(config.steps), self.eval_loss)

    def step(self, step: int, stop: _StopRequest) -> tuple[dict[str, Any], bool]:
        """One optimizer step; its metrics record, and whether any rank was asked to stop."""
        config, ctx = self.config, self.ctx
        t0 = time.perf_counter()
        lr = learning_rate(step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        local = self.batches.global_batch(step)[ctx.rank::ctx.world_size]  # this rank's shard of the global batch
        sums = _accumulate_gradients(self.model, self.objective, local, config, self.accumulation, ctx.device)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        agreed = torch.cat([sums, torch.tensor([float(stop.signum > 0)], device=ctx.device)])
        if ctx.world_size > 1:
            dist.all_reduce(agreed)  # the mean loss and its terms, and whether any rank was asked to stop
        means, stopping_now = (agreed[:-1] / ctx.world_size).tolist(), bool(agreed[-1] > 0)
        loss_value = means[0]
        if not math.isfinite(loss_value):
            raise LadderError(f"the loss became {loss_value} at step {step}: lower lr (now {lr:g})")
        self.losses.append(loss_value)
        tokens_per_step = config.batch_size * config.seq_len
        record: dict[str, Any] = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                                  "tokens": (step + 1) * tokens_per_step,
                                  "tokens_per_s": tokens_per_step / (time.perf_counter() - t0)}
        if self.teacher is not None:  # the terms of a distillation loss
            record.update(zip(self.objective.terms, means[1:]))
        if self.heldout is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
            self.eval_loss = evaluate_loss(self.net, self.heldout, config, ctx)
            record.update(eval_loss=self.eval_loss, eval_ppl=math.exp(self.eval_loss))
            if config.eval_quantize is not None:
                quantized = evaluate_loss(quantized_copy(self.core, config.eval_quantize), self.heldout, config, ctx)
                record[f"eval_loss_{config.eval_quantize}"] = quantized
        return record, stopping_now

    def save(self, step: int) -> Path:
        return save_checkpoint(self.out_dir, step, self.core, self.optimizer, self.config, self.tokenizer,
                               self.ctx.rank, self.ctx.world_size, self.run_state)


def _simulated_ranks_if_desync(model: Any, config: TrainConfig, world: int) -> Any:
    """Desync trains every simulated TP rank inside each process (`ladder.train.simulate`); other layouts
    as is."""
    if model.config.layout != "desync":
        return model
    if world > 1 and config.parallel == "fsdp":
        raise LadderError("desync training simulates its ranks inside each process, which FSDP cannot shard: "
                          "use parallel=ddp")
    return SimulatedRanks(model, model.config.desync_tp)


def _data_parallel(model: Any, config: TrainConfig, world: int) -> Any:
    """Wrap the model for data parallelism over `world` ranks (FSDP2 or DDP); alone, unchanged."""
    if world == 1:
        return model
    # Imported here: torch's FSDP and DDP modules take half a second to import, which no other command pays.
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if config.parallel == "fsdp":
        # FSDP2 gathers parameters in a module's forward hooks; the layout loop calls the attention
        # and MLP modules (not Block.forward), so those are the units; norms and embeddings go to the root.
        for layer in model.layers:
            fully_shard(layer.attention)
            fully_shard(layer.feed_forward)
        fully_shard(model)
        return model
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


def _accumulate_gradients(model: Any, objective: Objective, local: torch.Tensor, config: TrainConfig,
                          accumulation: int, device: torch.device) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches; returns the summed loss, then each of its terms
    (`objective.terms`), already divided by the accumulation steps, so that the sum over ranks / world is
    the global batch's mean."""
    sums = torch.zeros(1 + len(objective.terms), device=device)
    model.train()
    for micro in local.split(config.micro_batch_size):  # (micro_batch_size, seq_len + 1) token ids
        micro = micro.to(device)
        with _autocast(config, device):
            terms = objective.losses(model, micro[:, :-1], micro[:, 1:])
        loss = objective.total(terms) / accumulation
        loss.backward()
        sums += torch.stack([loss.detach(), *(terms[name].detach() / accumulation for name in objective.terms)])
    return sums


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
        # A launcher passes its own signal on to its workers, at times only once this rank has saved and
        # is on its way out: Python's own handler would then replace the stop with a bare KeyboardInterrupt.
        still_ignored = self.signum > 0 and under_torchrun()
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_IGN if still_ignored else handler)

    def raise_stop(self, said: str) -> None:
        if self.signum in (0, signal.SIGINT):
            raise KeyboardInterrupt(said)
        raise Stopped(self.signum, said)


def quantized_copy(model: Transformer, mode: str) -> Transformer:
    """A copy of the model being trained with its block linears quantized (`ladder.quant.quantize`): the
    held-out loss a user who serves it `--quantize`d would see."""
    copy = copy_module.deepcopy(model, memo={id(model.comm): model.comm})  # the same group, not a copy
    quantize_shard(copy, mode)
    return copy


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
