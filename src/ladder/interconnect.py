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
The tensor is left as it is (each rank's partial stands in for the sum): timings are meaningful,
values are not, so emulated results are always labelled as emulated.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ladder.distributed import Handle
from ladder.errors import LadderError


@dataclass(frozen=True)
class LinkModel:
    name: str
    latency_us: float  # per all-reduce, independent of size
    bandwidth_gbps: float  # bus bandwidth in GB/s (10^9 bytes per second)
    source: str = ""

    def all_reduce_s(self, n_bytes: int, world_size: int) -> float:
        """Modelled duration of a ring all-reduce of `n_bytes` over `world_size` ranks, in seconds."""
        if world_size <= 1:
            return 0.0
        traffic = 2 * (world_size - 1) / world_size * n_bytes
        return self.latency_us * 1e-6 + traffic / (self.bandwidth_gbps * 1e9)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _fit_two_points(small: tuple[int, float], large: tuple[int, float], world: int) -> tuple[float, float]:
    """(latency_us, bandwidth_gbps) of the line through two (bytes, microseconds) all-reduce timings."""
    ring = 2 * (world - 1) / world
    (b1, t1), (b2, t2) = small, large
    bandwidth = ring * (b2 - b1) / ((t2 - t1) * 1e-6) / 1e9
    latency = t1 - ring * b1 / (bandwidth * 1e9) * 1e6
    return latency, bandwidth


# Calibration from the ladder paper (ICML 2025) on 8x H100 SXM, fp16:
#  * its NCCL measurement: an all-reduce of 1M fp32 elements (4 MiB) takes 0.0786 ms with P2P (NVLink)
#    and 0.1354 ms with NCCL_P2P_DISABLE=1;
#  * its Llama-3-70B table at batch 1, TP 8: standard minus upper-bound time per generated token,
#    divided by the 161 all-reduces of a token (2 per layer + 1), gives the cost of a 16 KiB
#    all-reduce (1 x 8192 fp16): 1/77.39 - 1/110.59 s -> 24.2 us (P2P on); 1/51.66 - 1/110.59 s -> 64.1 us
#    (P2P off; upper bound has no communication, so its time does not depend on P2P).
_MIB4 = 4 * 1024 * 1024
_KIB16 = 16 * 1024
_ON = _fit_two_points((_KIB16, (1 / 77.39 - 1 / 110.59) / 161 * 1e6), (_MIB4, 78.6), 8)
_OFF = _fit_two_points((_KIB16, (1 / 51.66 - 1 / 110.59) / 161 * 1e6), (_MIB4, 135.4), 8)

LINKS: dict[str, LinkModel] = {
    "nvlink-h100": LinkModel("nvlink-h100", *_ON,
                             "ladder paper, 8x H100 NVLink: NCCL 4 MiB all-reduce 78.6 us + 70B TP8 bs1 gap"),
    "pcie-no-p2p": LinkModel("pcie-no-p2p", *_OFF,
                             "ladder paper, 8x H100 with NCCL_P2P_DISABLE=1: 4 MiB in 135.4 us + 70B TP8 bs1 gap"),
    # PCIe Gen5 x16 peer-to-peer: ~50 GB/s per direction; NCCL ring bus bandwidth over a PCIe switch is
    # typically ~40 GB/s, small-message latency ~20 us (NCCL tests on PCIe H100 systems, order of magnitude).
    "pcie-p2p": LinkModel("pcie-p2p", 20.0, 40.0, "PCIe Gen5 P2P: ~40 GB/s ring bus bandwidth, ~20 us latency"),
    # InfiniBand NDR: 400 Gb/s = 50 GB/s per port; cross-node all-reduce latency ~ 30 us (NCCL over IB).
    "infiniband-ndr": LinkModel("infiniband-ndr", 30.0, 45.0,
                                "InfiniBand NDR 400 Gb/s: ~45 GB/s achievable, ~30 us latency"),
}


def get_link(name: str, latency_us: float | None = None, bandwidth_gbps: float | None = None) -> LinkModel | None:
    """The link model for `--interconnect`: None for `real`, a preset, or `custom` from the two numbers."""
    if name == "real":
        return None
    if name == "custom":
        if latency_us is None or bandwidth_gbps is None:
            raise LadderError("--interconnect custom needs --link-latency-us and --link-bandwidth-gbps")
        if latency_us < 0 or bandwidth_gbps <= 0:
            raise LadderError(f"link latency must be >= 0 and bandwidth > 0, got {latency_us} us, {bandwidth_gbps} GB/s")
        return LinkModel("custom", latency_us, bandwidth_gbps, "given on the command line")
    if name not in LINKS:
        raise LadderError(f"unknown interconnect {name!r}; known: real, custom, {', '.join(LINKS)}")
    link = LINKS[name]
    if latency_us is not None or bandwidth_gbps is not None:
        link = LinkModel(link.name + "*", latency_us if latency_us is not None else link.latency_us,
                         bandwidth_gbps if bandwidth_gbps is not None else link.bandwidth_gbps,
                         link.source + " (overridden)")
    return link


class _DeadlineHandle:
    def __init__(self, result: torch.Tensor, deadline: float) -> None:
        self.result = result
        self.deadline = deadline

    def wait(self) -> torch.Tensor:
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

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream().wait_event(self.event)
        return self.result


class EmulatedCommunicator:
    """One rank of a `world_size`-way group whose collectives take the time `link` says.

    `scale` multiplies every modelled duration: a slow device (a CPU standing in for a GPU) can keep
    the compute : communication ratio of the real system by dilating the link by the same factor.
    """

    def __init__(self, link: LinkModel, world_size: int, device: torch.device, scale: float = 1.0) -> None:
        self.link, self.world_size, self.rank, self.scale = link, world_size, 0, scale
        self.device = device
        self.link_free_at = 0.0
        self.modelled_s = 0.0  # total modelled communication time (for reports)
        self.count = 0
        if device.type == "cuda":
            self.side_stream = torch.cuda.Stream(device)
            self.cycles_per_s = _sleep_cycles_per_second(device)

    def duration_s(self, x: torch.Tensor) -> float:
        return self.link.all_reduce_s(x.numel() * x.element_size(), self.world_size) * self.scale

    def all_reduce_async(self, x: torch.Tensor) -> Handle:
        duration = self.duration_s(x)
        self.modelled_s += duration
        self.count += 1
        if self.device.type == "cuda":
            return self._cuda_sleep(x, duration)
        start = max(time.perf_counter(), self.link_free_at)
        self.link_free_at = start + duration
        return _DeadlineHandle(x, self.link_free_at)

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


__all__ = ["LINKS", "EmulatedCommunicator", "LinkModel", "get_link", "wait_until"]
