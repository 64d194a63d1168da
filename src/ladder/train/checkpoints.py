"""Training checkpoints, written so that no work is lost: every rank's optimizer and RNG state beside
the weights (a Hugging Face model folder, `ladder.checkpoint.hf.write_hf_files`), in a temporary
folder renamed into place once complete; `--resume` continues from the newest."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import socket
import uuid
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ladder.checkpoint.hf import open_hf, write_hf_files
from ladder.comm.distributed import from_every_rank
from ladder.console import say
from ladder.errors import LadderError
from ladder.files import check_room, folder_bytes, safetensors_damage, writing
from ladder.model.weights import export_hf_state_dict, load_weights
from ladder.train.lora import ADAPTERS_FILE, has_lora, load_adapters, merged, save_adapters
from ladder.train.settings import TrainConfig


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
                    config: TrainConfig, tokenizer: Any, rank: int = 0, world: int = 1,
                    run_state: dict[str, Any] | None = None) -> Path:
    """Write step-N atomically; every rank calls this. Full weights are gathered on every rank (FSDP
    shards them), each rank adds its own optimizer and RNG state, and rank 0 renames the temporary
    folder into place once all are written, then keeps only the newest `keep_checkpoints`. LoRA adapters
    are merged into the weights written, and saved beside them too. `run_state` (the teacher's digest)
    goes into trainer_state.json, for `--resume` to check.

    A checkpoint the disk cannot hold (about the size of the one before) is refused before any byte is
    written; a write that fails anyway stops every rank with the same line, and removes the temporary
    folder: the older checkpoints stay whole (`ladder.files`)."""
    root = out_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    full = _full_parameters(model)  # a collective under FSDP: all ranks, same order
    refusal = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        refusal = _room_refusal(out_dir, final, full, optimizer, world)
        if refusal is None:
            tmp.mkdir()
    _every_rank_stops_on(from_every_rank(refusal))
    try:
        failed = _failed_write(final / f"optimizer-rank{rank}.pt", lambda: torch.save(
            {"optimizer": optimizer.state_dict(), "rng": _rng_state(), "world_size": world}, tmp / f"optimizer-rank{rank}.pt"))
        if rank == 0 and failed is None:
            failed = _failed_write(final, lambda: _write_model_files(tmp, final, model, full, config, tokenizer))
        _every_rank_stops_on(from_every_rank(failed))
        if rank == 0:
            state = {"step": step, "world_size": world, **(run_state or {})}
            with writing(final):
                (tmp / "trainer_state.json").write_text(json.dumps(state) + "\n")
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


def _write_model_files(tmp: Path, final: Path, model: Any, full: dict[str, torch.Tensor], config: TrainConfig,
                       tokenizer: Any) -> None:
    weights = merged(full, config.lora_alpha / config.lora_rank) if has_lora(full) else full
    write_hf_files(tmp, model.config, export_hf_state_dict(model, weights), tokenizer, final)
    if has_lora(full):
        save_adapters(full, tmp)
    (tmp / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")


def _failed_write(path: Path, write: Any) -> str | None:
    """The one line of a write that the file system refused, or None when it was written."""
    def written() -> None:
        with writing(path):
            write()
    return _refusal(written)


def _refusal(call: Any) -> str | None:
    """The one line `call` refused with (a LadderError), or None: for every rank to hear before it raises."""
    try:
        call()
    except LadderError as exc:
        return str(exc)
    return None


def _every_rank_stops_on(said: list[Any]) -> None:
    """Every rank raises the first rank's refusal, so that none waits for the others at a collective."""
    first = next((line for line in said if line is not None), None)
    if first is not None:
        raise LadderError(first)


def _room_refusal(out_dir: Path, final: Path, full: dict[str, torch.Tensor], optimizer: Any, world: int) -> str | None:
    """Why the disk cannot hold this checkpoint, or None. It needs what the newest one took, or, for the
    first, the weights and Adam's two moments of each trainable parameter on every rank."""
    newest = checkpoint_dirs(out_dir)
    if newest:
        needed = folder_bytes(newest[-1])
    else:
        weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in full.values()}.values())
        moments = sum(2 * getattr(p, "to_local", lambda: p)().numel() * 4  # (an FSDP shard: this rank's part)
                      for group in optimizer.param_groups for p in group["params"])
        needed = weights + moments * world
    return _refusal(lambda: check_room(final.parent, needed, f"checkpoint {final.name}"))


def check_out_dir_is_shared(out_dir: Path, rank: int, world: int) -> None:
    """Every rank writes its part of each checkpoint into out_dir, and reads it back on --resume: on
    several machines out_dir must be one folder they all share. Found out before training starts, not
    at the first checkpoint, hours in."""
    if world == 1:
        return
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
        dist.barrier()


def _full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor (FSDP2 keeps DTensor shards: gather them)."""
    from torch.distributed.tensor import DTensor  # (half a second to import: kept off other commands)

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters(remove_duplicate=False)}


def load_latest_checkpoint(out_dir: Path, model: Any, run_state: dict[str, Any] | None = None,
                           rank: int = 0) -> Path:
    """Load the newest whole checkpoint's weights into `model` (a LoRA run: its adapters, onto the base it
    was built with), after checking that it was written by this run's model and teacher (`run_state`). A
    damaged newest one (a file missing or cut short) is passed over for the one before, in one line."""
    found = checkpoint_dirs(out_dir)
    if not found:
        raise LadderError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
    damaged = []
    for candidate in reversed(found):
        if (problem := checkpoint_damage(candidate)) is None:
            break
        damaged.append(f"{candidate.name}: {problem}")
    else:
        raise LadderError(f"--resume: no whole checkpoint under {out_dir / 'checkpoints'} ({'; '.join(damaged)})")
    if damaged and rank == 0:
        say(f"ladder: resuming from {candidate.name}, the newest whole checkpoint ({'; '.join(damaged)})")
    checkpoint = open_hf(candidate)
    if checkpoint.config.canonical() != model.config.canonical():
        raise LadderError(f"{candidate} holds a model of another shape or layout than this config builds")
    saved = json.loads((candidate / "trainer_state.json").read_text())
    for key, value in (run_state or {}).items():
        if saved.get(key) != value:
            raise LadderError(f"{candidate} was trained with another {key.replace('_', ' ')} ({saved.get(key)}) than "
                              f"this run has ({value}): resume with the same one")
    if has_lora(dict(model.named_parameters())):
        load_adapters(model, candidate)
    else:
        load_weights(model, checkpoint.source)
    return candidate


def checkpoint_damage(folder: Path) -> str | None:
    """What is missing or cut short in a checkpoint folder, naming the file; None when it is whole. The
    checks read headers and zip directories, not the tensors: the weights' files must be as long as their
    header says, and each rank's optimizer file must end in its zip directory."""
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
        world = int(state["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return "trainer_state.json is missing or cut short"
    index = folder / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
            "model.safetensors"]
    except (OSError, ValueError, KeyError):
        return f"{index.name} is cut short"
    adapters = [ADAPTERS_FILE] if (folder / ADAPTERS_FILE).exists() else []
    for name in [*shards, *adapters]:
        if (problem := safetensors_damage(folder / name)) is not None:
            return f"{name} {problem}"
    for rank in range(world):
        name = f"optimizer-rank{rank}.pt"
        try:
            with zipfile.ZipFile(folder / name):
                pass
        except FileNotFoundError:
            return f"{name} is missing"
        except (OSError, zipfile.BadZipFile):
            return f"{name} is cut short"
    return None


def resume_optimizer(latest: Path, optimizer: Any, rank: int, world: int) -> int:
    state_file = latest / f"optimizer-rank{rank}.pt"
    saved_world = json.loads((latest / "trainer_state.json").read_text()).get("world_size", 1)
    if saved_world != world or not state_file.is_file():
        raise LadderError(f"{latest} was written by {saved_world} ranks; resume it with the same world size "
                          f"(now {world})")
    state = torch.load(state_file, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    return int(json.loads((latest / "trainer_state.json").read_text())["step"])
