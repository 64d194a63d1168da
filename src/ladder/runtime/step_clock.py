"""Timing a generation's steps without waiting for the device after each one.

On a GPU the host queues a step's kernels (or replays its CUDA graph) and can queue the next step as
soon as the sampled ids, which stay on the device, are queued too. Waiting for every step to finish
only to read a clock idles the GPU while the host samples, copies the next inputs and launches the
next step: 0.26 ms of a 6.8 ms Llama-3-8B step on an H100 (results/gpu/h100/report.md, "p50 minus
span"). So a step is timed by marks on the device's own timeline, CUDA events, read once the
generation is done.

A lap runs from the previous mark to this one: consecutive laps cover the timeline without a gap, and
time the GPU spent waiting for the host counts, in the lap of the step it waited for. Generations that
take turns on one device share a clock, so that each lap is one step of one of them. On a CPU the host
runs each step to its end, and a mark is the host's clock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Mark = float | torch.cuda.Event  # host seconds (CPU) or an event on the device's current stream


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Lap:
    start: Mark
    end: Mark

    def seconds(self) -> float:
        """The lap's length; on a GPU, waits until its end has run."""
        if isinstance(self.end, float):  # (marks of one clock are all host times or all events)
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class StepClock:
    """Laps on one device, each ending where it is taken (see the module's docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last: Mark | None = None

    @property
    def running(self) -> bool:
        return self._last is not None

    def start(self) -> None:
        """Wait for the work queued on the device, then mark: the next lap starts here."""
        synchronize(self.device)
        self._last = self._mark()

    def lap(self) -> Lap:
        """A lap from the previous mark to the work queued so far."""
        if self._last is None:
            raise RuntimeError("start the clock before taking a lap")
        mark = self._mark()
        lap, self._last = Lap(self._last, mark), mark
        return lap

    def _mark(self) -> Mark:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event


def to_device(values: Sequence, device: torch.device) -> torch.Tensor:
    """A (nested) list of ints as a tensor on `device`. To a GPU through pinned memory, without waiting:
    a copy from pageable memory waits for every kernel queued before it (the next step's positions
    would wait for the step before)."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)
