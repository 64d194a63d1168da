"""The cost-model variants tried and dropped (docs/costmodel.md). Each is fitted like the stored
model, on the paper's Llama-3-70B table at batch 1 and 64, then judged on the held-out batch sizes 4 and
16 and on the never-fitted 8B and 405B speedups; one line per variant. About 40 s on 2 cores.

Run: .venv/bin/python scripts/costmodel_variants.py"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from unittest import mock

import torch

from ladder import costmodel
from ladder.costmodel import (BOUNDS, GPUS, P2P_LINKS, TRAIN_BATCHES, UNSEEN_SETTINGS, CostConstants, LinkOf,
                              fit_constants, paper_table, predict_seconds_of, score, unseen_rows, validate,
                              validate_unseen)
from ladder.interconnect import Collectives, LinkModel, link_presets, paper_measurements

# NCCL's model of a ring all-reduce per protocol (src/graph/tuning.cc, NCCL 2.19 on): base latency and
# latency per ring step in us on NVLink / PCI, and the protocol's share of the bus bandwidth. LL gets half,
# at most 141 GB/s on Hopper; LL128 gets 0.92 and runs over NVLink only; Simple gets all of it.
PROTOCOLS = {"nvlink": {"LL": (6.6, 0.6, 0.5), "LL128": (14.0, 1.9, 0.92), "Simple": (8.4, 3.4, 1.0)},
             "pci": {"LL": (6.6, 1.0, 0.5), "Simple": (8.4, 5.7, 1.0)}}
LL_MAX_BUS_GBPS = 141.0


def protocol_all_reduce_us(hw: str, latency_us, per_rank_us, bandwidth_gbps, n_bytes: float, world_size: int):
    """The cheapest protocol's time: LL's latency is fitted (as a preset's), the others' differ from it by
    NCCL's constants. Works on floats and on tensors (for the fit)."""
    steps, traffic = 2 * (world_size - 1), 2 * (world_size - 1) / world_size * n_bytes
    ll_base, ll_step, _ = PROTOCOLS[hw]["LL"]
    times = []
    for protocol, (base, per_step, share) in PROTOCOLS[hw].items():
        bus = bandwidth_gbps * share
        if protocol == "LL":
            bus = torch.clamp(bus, max=LL_MAX_BUS_GBPS) if isinstance(bus, torch.Tensor) else min(bus, LL_MAX_BUS_GBPS)
        latency = latency_us + per_rank_us * (world_size - 2) + (base - ll_base) + steps * (per_step - ll_step)
        times.append(latency + traffic / (bus * 1e3))
    return torch.stack(times).min() if isinstance(times[0], torch.Tensor) else min(times)


@dataclass(frozen=True)
class ProtocolLink:
    name: str
    hw: str
    latency_us: float
    latency_per_rank_us: float
    bandwidth_gbps: float

    def all_reduce_s(self, n_bytes: int, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        return protocol_all_reduce_us(self.hw, self.latency_us, self.latency_per_rank_us, self.bandwidth_gbps,
                                      n_bytes, world_size) * 1e-6


def fit_protocol_link(name: str, hw: str, measurements: list[tuple[int, Collectives, float]]) -> ProtocolLink:
    """Least squares on relative error through the presets' own calibration data (Adam: the min over
    protocols is not linear)."""
    params = torch.tensor([15.0, 3.0, math.log(100.0)], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([params], lr=0.05)
    for _ in range(3000):
        optimizer.zero_grad()
        latency, per_rank, bandwidth = params[0], params[1], torch.exp(params[2])
        loss = sum((sum(count * protocol_all_reduce_us(hw, latency, per_rank, bandwidth, n_bytes, n)
                        for count, n_bytes in collectives) / total_us - 1) ** 2
                   for n, collectives, total_us in measurements)
        loss.backward()
        optimizer.step()
    latency, per_rank, log_bandwidth = (float(v) for v in params.detach())
    return ProtocolLink(name, hw, latency, per_rank, math.exp(log_bandwidth))


def protocol_links() -> LinkOf:
    fitted = {"nvlink-h100": fit_protocol_link("nvlink-h100", "nvlink", paper_measurements("on")),
              "pcie-no-p2p": fit_protocol_link("pcie-no-p2p", "pci", paper_measurements("off"))}
    return lambda name: fitted.get(name) or link_presets()[name]


def overlap_limited(compute: torch.Tensor, all_reduce: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """Interference slows the compute; it costs nothing while the transfer is the longer side."""
    return torch.maximum(compute + rho * torch.minimum(compute, all_reduce), all_reduce)


def knee_interference(k: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """Flat up to the batch 2**knee_log2, growing with log(batch) beyond it (a smooth corner)."""
    beyond = torch.nn.functional.softplus(4 * (torch.log2(batch) - k["knee_log2"])) / 4
    return torch.clamp(k["overlap_penalty"] + k["overlap_penalty_growth"] * beyond, max=1.0)


def loss_on_8b_speedups(link_of: LinkOf) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    rows = unseen_rows(UNSEEN_SETTINGS["llama-3-8b"])
    workloads, layouts = [w for w, *_ in rows], [layout for _, layout, _, _ in rows]
    links = [link_of(P2P_LINKS[p2p]) for _, _, p2p, _ in rows]
    published = torch.tensor([math.log(speedup) for *_, speedup in rows], dtype=torch.float64)

    def loss(k: dict[str, torch.Tensor]) -> torch.Tensor:
        standard = predict_seconds_of(workloads, ["standard"] * len(rows), GPUS["h100"], links, k)
        predicted = torch.log(standard / predict_seconds_of(workloads, layouts, GPUS["h100"], links, k))
        return ((predicted - published) ** 2).mean()
    return loss


def run(name: str, link_of: LinkOf = link_presets().__getitem__, interference=None, overlapped=None,
        knee_start: float | None = None, fit_8b: bool = False) -> None:
    init, bounds = asdict(CostConstants()), dict(BOUNDS)
    if knee_start is not None:
        init["knee_log2"], bounds["knee_log2"] = knee_start, (0.0, 6.0)
    with contextlib.ExitStack() as seams:  # the variant's pieces stand in for the model's own
        if interference:
            seams.enter_context(mock.patch.object(costmodel, "interference", interference))
        if overlapped:
            seams.enter_context(mock.patch.object(costmodel, "overlapped", overlapped))
        k = fit_constants([r for r in paper_table() if r["batch_size"] in TRAIN_BATCHES], init, bounds,
                          link_of=link_of, extra_loss=loss_on_8b_speedups(link_of) if fit_8b else None)
        held_out = validate(k, link_of=link_of)
        unseen = {s: validate_unseen(UNSEEN_SETTINGS[s], k, link_of=link_of) for s in UNSEEN_SETTINGS}
    detail = ""
    if knee_start is not None:
        knee = k["knee_log2"]
        detail = f"knee started at log2 batch {knee_start:g}, ended at {knee:.2f} (batch {2 ** knee:.1f})"
    eight_b = "fitted on" if fit_8b else score(unseen["llama-3-8b"])
    print(f"{name:<58}{score(held_out):>9}{eight_b:>11}{score(unseen['llama-3.1-405b']):>7}  {detail}", flush=True)


print(f"{'variant':<58}{'held out':>9}{'8B':>11}{'405B':>7}")
run("stored model")
links = protocol_links()
for preset in ("nvlink-h100", "pcie-no-p2p"):
    link = links(preset)
    print(f"  ({preset} as NCCL protocols: LL {link.latency_us:.1f} us + {link.latency_per_rank_us:.2f} us per rank "
          f"beyond 2, bus {link.bandwidth_gbps:.0f} GB/s, LL {min(LL_MAX_BUS_GBPS, link.bandwidth_gbps / 2):.0f} GB/s)")
run("link: the cheapest of NCCL's ring protocols", link_of=links)
run("interference hidden while the transfer is longer", overlapped=overlap_limited)
run("both", link_of=links, overlapped=overlap_limited)
for start in (0.5, 2.0, 3.0, 4.5):
    run("interference flat up to a fitted knee", interference=knee_interference, knee_start=start)
run("the knee, with the 8B speedups in the fit", interference=knee_interference, knee_start=2.0, fit_8b=True)
