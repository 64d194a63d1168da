"""Real process groups: `init_distributed()` (explicit: nothing runs at import time), the
`TorchCommunicator` on them (gloo on CPU, NCCL on CUDA), and what ranks tell each other to agree or
to fail together."""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ladder.comm.base import Communicator, Handle, LocalCommunicator
from ladder.errors import LadderError
from ladder.options import dist_timeout_s

# The functional collectives as their raw ops, on tensors and a group's name. funcol's eager wrappers
# (funcol.all_reduce returns an AsyncCollectiveTensor) keep the process group alive past
# destroy_process_group, and with it gloo's worker threads: one of them releasing its last collective
# after the interpreter has begun to finalize takes the GIL and aborts the process (SIGABRT,
# "terminate called without an active exception": pytorch#190489, seen under torchrun on two
# nodes). On the raw ops destroy_process_group joins those threads before we return.
_functional = torch.ops._c10d_functional


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    return _functional.wait_tensor(tensor)


class _FunctionalHandle:
    def __init__(self, pending: torch.Tensor) -> None:
        self.pending = pending

    def wait(self, after: torch.Tensor | None = None) -> torch.Tensor:
        if after is not None and torch.compiler.is_compiling():
            torch.ops.ladder.wait_after(self.pending, after)
            return self.pending
        return _wait(self.pending)


@torch.library.custom_op("ladder::wait_after", mutates_args=("tensor",))
def _wait_after(tensor: torch.Tensor, after: torch.Tensor) -> None:
    """The wait for `tensor`'s collective, ordered after `after` is computed. It "writes" `tensor`, so
    whatever reads the reduced tensor is ordered after the wait."""
    _wait(tensor)


class TorchCommunicator:
    """Collectives of a real `torch.distributed` process group (gloo on CPU, NCCL on CUDA).

    Functional collectives: in eager mode they launch asynchronously and complete at `wait()`; under
    torch.compile they trace into the graph (`async_op=True` work handles do not), so the compiler
    sees the same launch-early, wait-late schedule. Results are new tensors, not in place.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        group = group or dist.group.WORLD
        self.group_name = group.group_name  # (not the group: see _functional)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _wait(_functional.all_reduce(x, "sum", self.group_name))

    def all_reduce_async(self, x: torch.Tensor) -> Handle:
        # Launched here, waited where `Handle.wait()` is called, eagerly and traced alike (funcol's
        # wrapper would wait at once when traced, leaving the compiler to move the wait, which it does not).
        return _FunctionalHandle(_functional.all_reduce(x, "sum", self.group_name))

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        gathered = _wait(_functional.all_gather_into_tensor(x.contiguous(), self.world_size, self.group_name))
        return torch.cat(gathered.chunk(self.world_size, dim=0), dim=-1)  # (W*B, ...) -> (B, ..., W*D)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def communicator(self) -> Communicator:
        return TorchCommunicator() if self.world_size > 1 else LocalCommunicator()


def pick_device(requested: str | None, local_rank: int = 0) -> torch.device:
    """`cuda:<local_rank>` when CUDA is present (or asked for), else CPU."""
    if requested in (None, "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LadderError("--device cuda was asked for but CUDA is not available on this machine")
        return torch.device("cuda", local_rank if requested == "cuda" else int(requested.split(":")[1]))
    if requested != "cpu":
        raise LadderError(f"unknown device {requested!r}; use cpu, cuda or auto")
    return torch.device("cpu")


def init_distributed(device: str | None = None, timeout_s: float | None = None) -> DistContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    Works for one process (no group is created) and for multi-node runs: rank and world size are the
    global ones. The group has a timeout (default: LADDER_DIST_TIMEOUT's), so a rank that dies makes the
    others fail instead of hang.
    """
    timeout_s = dist_timeout_s() if timeout_s is None else timeout_s
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        try:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=dev if dev.type == "cuda" else None)
        except dist.DistStoreError:  # (a rank that stopped at bad input on its own node never joins)
            raise LadderError(f"not all {world_size} ranks joined within {timeout_s:g} s (at "
                              f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}); a rank that "
                              "failed to start says why on its own node (LADDER_DIST_TIMEOUT sets the wait)") from None
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def from_every_rank(value: object) -> list[object]:
    """Every rank's `value`, by rank (a collective: every rank calls it; alone: [value])."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def check_ranks_agree(value: object, what: str) -> None:
    """Raise on every rank, in one line, unless every rank has the same `value`.

    Under torchrun every node runs its own command line and reads its own files. Ranks that start from
    different inputs pair the collectives of different work: they compute nonsense without an error,
    or wait for each other until the timeout. So they compare what they are about to do first."""
    other = next((rank for rank, theirs in enumerate(from_every_rank(value)) if theirs != value), None)
    if other is not None:
        raise LadderError(f"rank {other} and rank {dist.get_rank()} have different {what}: start every node "
                          "with the same command and the same files")


def fingerprint(tokens: torch.Tensor | Sequence[int] | None) -> str | None:
    """A short stand-in for a long run of token ids, for ranks to compare."""
    if tokens is None:
        return None
    return hashlib.sha256(torch.as_tensor(tokens, dtype=torch.long).numpy().tobytes()).hexdigest()


def shutdown_distributed() -> None:
    if dist.is_initialized():
        # A gloo worker thread drops the tensors of the collective it just finished under the GIL, and the
        # group's destructor joins those threads while this thread holds the GIL: destroyed within a few
        # milliseconds of the last collective, the two waited on each other for ever (the end of a DDP
        # run, 1 in a few). Sleeping hands the GIL to them first.
        time.sleep(0.02)
        dist.destroy_process_group()
