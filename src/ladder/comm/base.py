"""The communicator the model talks through: two small protocols and the trivial one-rank implementation.

The model never calls `torch.distributed` itself. Every collective goes through a `Communicator`
passed to it, so a benchmark can substitute an emulated interconnect (`ladder.comm.emulated`) and a
test can record the schedule; `ladder.comm.distributed` implements it on a real process group.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Handle(Protocol):
    """A collective in flight. `wait()` blocks until it is done and returns the reduced tensor.

    `after`: a tensor the wait must come after, the compute this collective is meant to overlap.
    Eager code runs in program order and ignores it. Under torch.compile nothing else ties the wait
    to that compute, and inductor may move the wait forward, e.g. to fuse the residual add that reads
    its result into the previous norm's kernel, which serialises the step.
    """

    def wait(self, after: torch.Tensor | None = None) -> torch.Tensor: ...


class Communicator(Protocol):
    """Sum-reductions across the tensor-parallel group. Use the returned tensor (an implementation may
    reduce in place or return a new tensor)."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_async(self, x: torch.Tensor) -> Handle: ...

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor: ...


class Done:
    """A handle whose result is already available."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def wait(self, after: torch.Tensor | None = None) -> torch.Tensor:
        return self.result


class LocalCommunicator:
    """World size 1: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_async(self, x: torch.Tensor) -> Handle:
        return Done(x)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x
