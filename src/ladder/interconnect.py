"""Emulated interconnects: link models, and a communicator that waits instead of communicating.

A link model gives the duration of a ring all-reduce:  t(bytes, N) = latency + 2 (N-1)/N * bytes / bw.
`EmulatedCommunicator` computes the real sharded work of one rank but replaces each all-reduce by a
wait of that duration which occupies no compute:
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
import dataclasses
import functools
import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from time import perf_counter

import torch

from ladder.distributed import Handle
from ladder.errors import LadderError


@dataclass(frozen=True)
class LinkModel:
    name: str
    latency_us: float  # per all-reduce over 2 ranks, independent of size
    bandwidth_gbps: float  # bus bandwidth in GB/s (10^9 bytes per second)
    latency_per_rank_us: float = 0.0  # extra latency per rank beyond 2 (more ring/tree steps)
    source: str = ""

    def latency_s(self, world_size: int) -> float:
        return (self.latency_us + self.latency_per_rank_us * (world_size - 2)) * 1e-6

    def all_reduce_s(self, n_bytes: int, world_size: int) -> float:
        """Modelled duration of a ring all-reduce of `n_bytes` over `world_size` ranks, in seconds."""
        if world_size <= 1:
            return 0.0
        traffic = 2 * (world_size - 1) / world_size * n_bytes
        return self.latency_s(world_size) + traffic / (self.bandwidth_gbps * 1e9)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


Collectives = list[tuple[float, int]]  # (how many, bytes each) all-reduces of one measurement


def fit_link(name: str, measurements: list[tuple[int, Collectives, float]], source: str) -> LinkModel:
    """Least-squares link model through measurements (world_size, all-reduces, total microseconds):
    each says that running those all-reduces took that long. Linear in (latency, per-rank latency,
    1 / bandwidth), so this is one linear least-squares solve. Measurements at one world size cannot
    tell latency from per-rank latency: the latency is then that world size's, the same at every other."""
    one_world_size = len({n for n, _, _ in measurements}) == 1
    rows, totals = [], []
    for n, collectives, total_us in measurements:
        count = sum(c for c, _ in collectives)
        traffic = sum(c * 2 * (n - 1) / n * b for c, b in collectives)
        rows.append([count, traffic] if one_world_size else [count, count * (n - 2.0), traffic])
        totals.append(total_us)
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(totals, dtype=torch.float64)
    weight = 1.0 / y  # relative errors: small and large measurements count alike
    a, y = a * weight[:, None], y * weight
    scale = a.abs().max(dim=0).values  # columns differ by orders of magnitude
    sol = [float(v) for v in torch.linalg.lstsq(a / scale, y[:, None]).solution[:, 0] / scale]
    latency, per_rank, us_per_byte = (sol[0], 0.0, sol[1]) if one_world_size else sol
    # Rounded far below any physical meaning: the solve's last bits vary from run to run (threaded
    # BLAS), and results files name a link by its numbers (`ladder bench --resume` matches on them).
    return LinkModel(name, round(latency, 6), round(1.0 / us_per_byte / 1e3, 6), round(per_rank, 6), source)


CALIBRATION_BATCHES = (1, 64)  # the cost model is judged on the other batch sizes of the table


def paper_measurements(p2p: str, calibrates: Callable[[int, int], bool] | None = None
                       ) -> list[tuple[int, Collectives, float]]:
    """All-reduce timings implied by the ladder paper (ICML 2025), 8x H100 SXM, fp16:
    * its NCCL measurement: 1M fp32 elements (4 MiB) on 8 GPUs take 78.6 us with P2P (NVLink) and
      135.4 us with NCCL_P2P_DISABLE=1;
    * its Llama-3-70B rows at batch 1 and 64: the time standard takes beyond upper bound is the time
      of its 160 all-reduces per forward (2 per layer; gpt-fast shards attention and MLP only), over
      one prefill of batch x 1024 tokens and 512 decode steps of batch tokens, each message
      tokens x 8192 x 2 bytes. Upper bound does not
      communicate, so its P2P-on time serves both conditions.
    `calibrates(tp, batch)`: which of the table's rows to take instead (a cross-validation's folds)."""
    from ladder.costmodel import paper_table  # the packaged CSV

    rows = {(r["layout"], r["tp"], r["batch_size"], r["p2p"]): r for r in paper_table()}
    out: list[tuple[int, Collectives, float]] = [(8, [(1, 4 * 2**20)], 78.6 if p2p == "on" else 135.4)]
    for (layout, tp, batch, cond), r in rows.items():
        taken = calibrates(tp, batch) if calibrates else batch in CALIBRATION_BATCHES
        if layout != "standard" or cond != p2p or not taken:
            continue
        upper = rows[("upper-bound", tp, batch, "on")]
        tokens = batch * r["gen_len"]
        gap_us = (tokens / r["tokens_per_s"] - tokens / upper["tokens_per_s"]) * 1e6
        message = 8192 * 2
        out.append((tp, [(160, batch * r["prompt_len"] * message), (160 * r["gen_len"], batch * message)], gap_us))
    return out


@functools.cache
def link_presets() -> dict[str, LinkModel]:
    """The named links of `--interconnect`, with where each number comes from."""
    return {
        "nvlink-h100": fit_link("nvlink-h100", paper_measurements("on"),
                                "ladder paper, 8x H100 NVLink: NCCL 4 MiB all-reduce + 70B standard-vs-upper-bound "
                                "gaps at batch 1 and 64"),
        "pcie-no-p2p": fit_link("pcie-no-p2p", paper_measurements("off"),
                                "ladder paper, 8x H100, NCCL_P2P_DISABLE=1: NCCL 4 MiB all-reduce + 70B gaps at "
                                "batch 1 and 64"),
        # PCIe Gen5 x16 peer-to-peer: ~50 GB/s per direction; NCCL ring bus bandwidth through a PCIe
        # switch ~40 GB/s, small-message latency ~20 us (order of magnitude of NCCL tests on PCIe H100s).
        "pcie-p2p": LinkModel("pcie-p2p", 20.0, 40.0, 1.0, "PCIe Gen5 P2P: ~40 GB/s bus bandwidth, ~20 us latency"),
        # InfiniBand NDR: 400 Gb/s = 50 GB/s per port, ~45 achievable; NCCL over IB latency ~30 us.
        "infiniband-ndr": LinkModel("infiniband-ndr", 30.0, 45.0, 2.0,
                                    "InfiniBand NDR 400 Gb/s: ~45 GB/s achievable, ~30 us latency"),
    }


def get_link(name: str, latency_us: float | None = None, bandwidth_gbps: float | None = None) -> LinkModel | None:
    """The link model for `--interconnect`: None for `real`, a preset (its numbers overridden where
    given), or `custom` from the two numbers."""
    if latency_us is not None and latency_us < 0:
        raise LadderError(f"--link-latency-us must be >= 0, got {latency_us:g}")
    if bandwidth_gbps is not None and bandwidth_gbps <= 0:
        raise LadderError(f"--link-bandwidth-gbps must be > 0, got {bandwidth_gbps:g}")
    if name == "real":
        return None
    if name == "custom":
        if latency_us is None or bandwidth_gbps is None:
            raise LadderError("--interconnect custom needs --link-latency-us and --link-bandwidth-gbps")
        return LinkModel("custom", latency_us, bandwidth_gbps, source="given on the command line")
    presets = link_presets()
    if name not in presets:
        raise LadderError(f"unknown interconnect {name!r}; known: real, custom, {', '.join(presets)}")
    link = presets[name]
    if latency_us is not None or bandwidth_gbps is not None:
        link = dataclasses.replace(
            link, name=link.name + "*", source=link.source + " (overridden)",
            latency_us=latency_us if latency_us is not None else link.latency_us,
            bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else link.bandwidth_gbps)
    return link


def get_links(names: Sequence[str], latency_us: float | None, bandwidth_gbps: float | None) -> list[LinkModel | None]:
    """`get_link` for each name of `--interconnect`; link numbers with only `real` named would be
    silently ignored, so they are refused."""
    links = [get_link(name, latency_us, bandwidth_gbps) for name in names]
    if (latency_us is not None or bandwidth_gbps is not None) and all(link is None for link in links):
        raise LadderError("--link-latency-us and --link-bandwidth-gbps describe an emulated link, and "
                          "--interconnect real has none: add --interconnect custom (or a preset to override)")
    return links


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


__all__ = ["EmulatedCommunicator", "LinkModel", "get_link", "get_links", "link_presets", "wait_until"]
