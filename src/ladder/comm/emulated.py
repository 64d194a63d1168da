"""Emulated interconnects: a communicator that waits instead of communicating.

`EmulatedCommunicator` computes the real sharded work of one rank but replaces each all-reduce by a
wait of the duration a link model (`ladder.comm.links`) gives it, which occupies no compute:
  * CPU: the link is a resource busy until a deadline. Launching an all-reduce books the next slot
    (collectives run one after another, as on one NCCL stream); `wait()` sleeps until the slot ends.
    Compute issued between launch and wait proceeds meanwhile, exactly as it would with a real
    asynchronous collective. (No helper thread is needed: the waiting thread is idle anyway.)
  * CUDA: a sleep kernel on a side stream, ordered after the producer of the tensor; `wait()` makes
    the compute stream wait on the side stream's event. Safe inside CUDA-graph capture.
Under torch.compile the launch and the wait are two custom ops (`ladder::emulated_all_reduce`,
`ladder::emulated_wait`), so a decode step stays one graph, one CUDA graph with mode="reduce-overhead",
as it does with NCCL's functional collectives; their bodies run when the step runs (on CUDA: when it is
captured, and the sleep kernels replay with the graph). A graph break per all-reduce instead would add
Python between every module: on a 70B shard's 160 all-reduces a step, as long as the step itself.
The tensor is left as it is (each rank's partial stands in for the sum): timings are meaningful,
values are not, so emulated results are always labelled as emulated.
"""

from __future__ import annotations

import collections
import functools
import itertools
import time
import weakref
from time import perf_counter

import torch

from ladder.comm.base import Handle
from ladder.comm.links import LinkModel


class _DeadlineHandle:
    __slots__ = ("result", "deadline", "comm")

    def __init__(self, result: torch.Tensor, deadline: float, comm: EmulatedCommunicator) -> None:
        self.result = result
        self.deadline = deadline
        self.comm = comm

    def wait(self, after: torch.Tensor | None = None) -> torch.Tensor:
        # What was still left of the modelled transfer when compute needed the result: not hidden.
        # (Late wake-ups of this thread are the emulation's overhead, not communication: not counted.)
        remaining = self.deadline - perf_counter()
        if remaining > 0:
            self.comm.exposed_s += remaining
            wait_until(self.deadline)
        return self.result


def wait_until(deadline: float) -> None:
    """Sleep until time.perf_counter() reaches `deadline`; the last fraction of a millisecond is spun
    for accuracy (the thread that waits has nothing else to do, so spinning costs no compute)."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > 1e-3:
            time.sleep(remaining - 5e-4)


class _CudaHandle:
    def __init__(self, result: torch.Tensor, event: torch.cuda.Event) -> None:
        self.result = result
        self.event = event

    def wait(self, after: torch.Tensor | None = None) -> torch.Tensor:
        torch.cuda.current_stream().wait_event(self.event)
        return self.result


class _TracedHandle:
    """An all-reduce launched inside a torch.compile graph: waited through the `emulated_wait` op."""

    def __init__(self, result: torch.Tensor, comm_id: int) -> None:
        self.result = result
        self.comm_id = comm_id

    def wait(self, after: torch.Tensor | None = None) -> torch.Tensor:
        torch.ops.ladder.emulated_wait(self.result, after, self.comm_id)
        return self.result


class EmulatedCommunicator:
    """One rank of a `world_size`-way group whose collectives take the time `link` says.

    `scale` multiplies every modelled duration: a slow device (a CPU standing in for a GPU) can keep
    the compute : communication ratio of the real system by dilating the link by the same factor.
    """

    def __init__(self, link: LinkModel, world_size: int, device: torch.device, scale: float = 1.0) -> None:
        self.link, self.world_size, self.rank, self.scale = link, world_size, 0, scale
        self.device = device
        self.comm_id = next(_comm_ids)  # how the ops of a compiled graph find this communicator
        _COMMUNICATORS[self.comm_id] = self
        self.in_flight: collections.deque[Handle] = collections.deque()  # launched by the ops, not yet waited
        self.link_free_at = 0.0
        self.modelled_s = 0.0  # total modelled communication time (for reports)
        self.exposed_s = 0.0  # of it, what was still in flight when wait() was called (CPU only)
        self.count = 0
        self.transfers: list[tuple[float, float]] | None = None  # (start, end) of each, when a trace wants them
        # Every eager all-reduce runs this class's Python between two of the model's matrix products,
        # where the interpreter runs cold, and upper bound runs none of it: kept short (`_launch`).
        # Durations are looked up by message size (a model sends few sizes; link and scale are fixed).
        self.on_cuda = device.type == "cuda"
        self._duration_of_bytes: dict[int, float] = {}
        if self.on_cuda:
            self.side_stream = torch.cuda.Stream(device)
            self.cycles_per_s = _sleep_cycles_per_second(device)

    def reset_counters(self) -> None:
        self.modelled_s, self.exposed_s, self.count = 0.0, 0.0, 0
        self.in_flight.clear()  # between generations nothing is in flight, unless a step raised midway

    @property
    def hidden_fraction(self) -> float | None:
        """The share of the modelled communication that overlapped compute, measured inside the run:
        1 - (still in flight at wait()) / modelled. Immune to the machine's speed drifting between runs,
        unlike comparing whole runs of different layouts. On CUDA the host cannot see it (the waits are on the GPU)."""
        if self.on_cuda or self.modelled_s == 0:
            return None
        return 1.0 - self.exposed_s / self.modelled_s

    def duration_s(self, x: torch.Tensor) -> float:
        n_bytes = x.nbytes
        duration = self._duration_of_bytes.get(n_bytes)
        if duration is None:
            duration = self._duration_of_bytes[n_bytes] = self.link.all_reduce_s(n_bytes, self.world_size) * self.scale
        return duration

    def all_reduce_async(self, x: torch.Tensor) -> Handle:
        return _launch(self, x)  # inside a torch.compile graph: `_launch_in_graph`

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_async(x).wait()

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        # Emulation keeps the local shard and tiles it to full width; timed like an all-reduce of it.
        handle = self.all_reduce_async(x)
        return torch.cat([handle.wait()] * self.world_size, dim=-1)

    def _cuda_sleep(self, x: torch.Tensor, duration: float) -> Handle:
        current = torch.cuda.current_stream(self.device)
        self.side_stream.wait_stream(current)  # the "collective" starts once x is produced
        with torch.cuda.stream(self.side_stream):
            torch.cuda._sleep(max(1, int(duration * self.cycles_per_s)))
            event = torch.cuda.Event()
            event.record(self.side_stream)
        return _CudaHandle(x, event)


_COMMUNICATORS: weakref.WeakValueDictionary[int, EmulatedCommunicator] = weakref.WeakValueDictionary()
_comm_ids = itertools.count()


def _launch(comm: EmulatedCommunicator, x: torch.Tensor) -> Handle:
    """Book the link for an all-reduce of x and return its handle. Eager steps call this directly
    (through the custom op it would cost ~100 us instead of ~10 on a CPU, charged to the layouts that
    communicate) and without asking `torch.compiler.is_compiling()` first, 2-5 us of a cold interpreter
    an all-reduce: a compiled step holds `_launch_in_graph` in its place (`trace_emulated_launches`)."""
    duration = comm.duration_s(x)
    comm.modelled_s += duration
    comm.count += 1
    if comm.on_cuda:
        return comm._cuda_sleep(x, duration)
    now = perf_counter()
    free = comm.link_free_at
    comm.link_free_at = end = (now if now > free else free) + duration
    if comm.transfers is not None:
        comm.transfers.append((end - duration, end))
    return _DeadlineHandle(x, end, comm)


@torch.library.custom_op("ladder::emulated_all_reduce", mutates_args=())
def _emulated_all_reduce(x: torch.Tensor, comm_id: int) -> torch.Tensor:
    """Launch an emulated all-reduce of x; its result is a new tensor, as with funcol.all_reduce."""
    result = x.clone()
    comm = _COMMUNICATORS[comm_id]
    comm.in_flight.append(_launch(comm, result))
    return result


@_emulated_all_reduce.register_fake
def _(x: torch.Tensor, comm_id: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("ladder::emulated_wait", mutates_args=("result",))
def _emulated_wait(result: torch.Tensor, after: torch.Tensor | None, comm_id: int) -> None:
    """Wait for the oldest all-reduce in flight, after `after` is computed (see `Handle.wait`). It
    "writes" `result`, so whatever reads the result is ordered after the wait. The waits of a model
    come in launch order: each result feeds the residual stream the next one is added to."""
    _COMMUNICATORS[comm_id].in_flight.popleft().wait()


def _launch_in_graph(comm: EmulatedCommunicator, x: torch.Tensor) -> Handle:
    """`_launch` as a torch.compile graph holds it: the launch op, its body run when the graph runs."""
    return _TracedHandle(torch.ops.ladder.emulated_all_reduce(x, comm.comm_id), comm.comm_id)


@functools.cache
def trace_emulated_launches() -> None:
    """Let torch.compile trace emulated all-reduces: dynamo, inlining `_launch`, puts `_launch_in_graph`
    in the graph in its place (without this, a compiled step with an emulated link fails to trace).
    Called before a step is compiled, not at import: it imports torch._dynamo (~1 s)."""
    torch.compiler.substitute_in_graph(_launch)(_launch_in_graph)


def _sleep_cycles_per_second(device: torch.device) -> float:
    """Calibrate torch.cuda._sleep: how many of its cycles make one second on this GPU."""
    cycles = 10_000_000
    torch.cuda._sleep(1000)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / (start.elapsed_time(end) / 1e3)


