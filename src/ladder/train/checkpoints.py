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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ladder.checkpoint.hf import open_hf, write_hf_files
from ladder.comm.distributed import from_every_rank
from ladder.errors import LadderError
from ladder.train.settings import TrainConfig
from ladder.weights import export_hf_state_dict, load_weights


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
            write_hf_files(tmp, model.config, export_hf_state_dict(model, full), tokenizer, final)
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


def load_latest_checkpoint(out_dir: Path, model: Any) -> Path:
    found = checkpoint_dirs(out_dir)
    if not found:
        raise LadderError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
    checkpoint = open_hf(found[-1])
    if checkpoint.config.canonical() != model.config.canonical():
        raise LadderError(f"{found[-1]} holds a model of another shape or layout than this config builds")
    load_weights(model, checkpoint.source)
    return found[-1]


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
