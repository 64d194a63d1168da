"""Link models: how long an all-reduce takes on an interconnect, and the named presets.

A link model gives the duration of a ring all-reduce:  t(bytes, N) = latency + 2 (N-1)/N * bytes / bw.
`fit_link` fits one through timings (the paper's, or this machine's: `ladder bench link`);
`ladder.comm.emulated` waits out its durations, and `ladder.predict` prices them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources

import torch

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


PAPER_LINKS_FILE = "data/paper-links.json"


@functools.cache
def link_presets() -> dict[str, LinkModel]:
    """The named links of `--interconnect`, with where each number comes from."""
    # The paper's two conditions, fitted to its measurements (`ladder.predict.paper.fit_paper_links`,
    # stored by experiments/costmodel/fit.py; a test checks that the stored links are that fit).
    fitted = json.loads(resources.files("ladder").joinpath(PAPER_LINKS_FILE).read_text())
    return {
        **{name: LinkModel(**fields) for name, fields in fitted.items()},
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
