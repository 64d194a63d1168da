"""The cost-model variants tried and dropped (docs/costmodel.md). Each is fitted like the stored
model, on the paper's Llama-3-70B table at batch 1 and 64, then judged on the held-out batch sizes 4 and
16 and on the never-fitted 8B and 405B speedups; one line per variant. About 30 s on 2 cores.

Run: .venv/bin/python experiments/costmodel/variants.py"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from unittest import mock

import torch

from ladder.comm.links import Collectives, link_presets
from ladder.predict import costmodel
from ladder.predict.costmodel import GPUS, CostConstants, LinkOf, predict_seconds_of
from ladder.predict.fit import BOUNDS, TRAIN_BATCHES, fit_constants, score, validate, validate_unseen
from ladder.predict.paper import P2P_LINKS, UNSEEN_SETTINGS, paper_measurements, paper_table, unseen_rows

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


def residuals_on_8b_speedups(link_of: LinkOf) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    rows = unseen_rows(UNSEEN_SETTINGS["llama-3-8b"])
    workloads, layouts = [w for w, *_ in rows], [layout for _, layout, _, _ in rows]
    links = [link_of(P2P_LINKS[p2p]) for _, _, p2p, _ in rows]
    published = torch.tensor([math.log(speedup) for *_, speedup in rows], dtype=torch.float64)

    def residuals(k: dict[str, torch.Tensor]) -> torch.Tensor:
        standard = predict_seconds_of(workloads, ["standard"] * len(rows), GPUS["h100"], links, k)
        return torch.log(standard / predict_seconds_of(workloads, layouts, GPUS["h100"], links, k)) - published
    return residuals


@dataclass(frozen=True)
class LatencyPerTPLink:
    """A link with its own latency at each TP degree (2, 4, 8) and one bandwidth, instead of a latency
    growing linearly with the ranks: with P2P off the table implies 21, 26 and 64 us at batch 1. Beyond
    the largest TP it was fitted on (the 405B's 16 ranks), that TP's latency."""
    name: str
    latency_us: dict[int, float]
    bandwidth_gbps: float

    def all_reduce_s(self, n_bytes: int, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        traffic = 2 * (world_size - 1) / world_size * n_bytes
        latency = self.latency_us.get(world_size, self.latency_us[max(self.latency_us)])
        return (latency + traffic / (self.bandwidth_gbps * 1e3)) * 1e-6


def fit_latency_per_tp_link(name: str, measurements: list[tuple[int, Collectives, float]]) -> LatencyPerTPLink:
    """Linear least squares on relative error, as `fit_link`: unknowns one latency per TP, 1 / bandwidth."""
    sizes = sorted({n for n, _, _ in measurements})
    rows = []
    for n, collectives, total_us in measurements:
        row = [0.0] * len(sizes) + [sum(c * 2 * (n - 1) / n * b for c, b in collectives)]
        row[sizes.index(n)] = sum(c for c, _ in collectives)
        rows.append([v / total_us for v in row])
    a = torch.tensor(rows, dtype=torch.float64)
    scale = a.abs().max(dim=0).values
    solution = torch.linalg.lstsq(a / scale, torch.ones(len(rows), 1, dtype=torch.float64)).solution[:, 0] / scale
    return LatencyPerTPLink(name, dict(zip(sizes, solution[:-1].tolist())), 1 / float(solution[-1]) / 1e3)


def latency_per_tp_links() -> LinkOf:
    fitted = {name: fit_latency_per_tp_link(name, paper_measurements(p2p)) for p2p, name in P2P_LINKS.items()}
    return lambda name: fitted.get(name) or link_presets()[name]


def flat_interference(k: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """The same rho at every batch size."""
    return torch.clamp(k["overlap_penalty"] + 0 * batch, max=1.0)


def own_prefill_interference(k: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    """The prefill's matmuls are compute-bound: their own rho, the same at every batch size."""
    return torch.clamp(k["prefill_penalty"] + 0 * batch, max=1.0)


def run(name: str, link_of: LinkOf = link_presets().__getitem__, seams: dict[str, Callable] | None = None,
        new_constants: dict[str, tuple[float, tuple[float, float]]] | None = None, dropped: tuple[str, ...] = (),
        fit_8b: bool = False) -> dict[str, float]:
    """Fit and judge one variant: `seams` are costmodel functions it replaces, `new_constants` its own
    (start, bounds), `dropped` the stored constants it does without."""
    init, bounds = asdict(CostConstants()), dict(BOUNDS)
    for constant in dropped:
        del init[constant]
    for constant, (start, bound) in (new_constants or {}).items():
        init[constant], bounds[constant] = start, bound
    with contextlib.ExitStack() as stack:  # the variant's pieces stand in for the model's own
        for function, replacement in (seams or {}).items():
            stack.enter_context(mock.patch.object(costmodel, function, replacement))
        k = fit_constants([r for r in paper_table() if r["batch_size"] in TRAIN_BATCHES], init, bounds,
                          link_of=link_of, extra_residuals=residuals_on_8b_speedups(link_of) if fit_8b else None)
        held_out = validate(k, link_of=link_of)
        unseen = {s: validate_unseen(UNSEEN_SETTINGS[s], k, link_of=link_of) for s in UNSEEN_SETTINGS}
    detail = ""
    if "knee_log2" in k:
        start, knee = new_constants["knee_log2"][0], k["knee_log2"]
        detail = f"knee started at log2 batch {start:g}, ended at {knee:.2f} (batch {2 ** knee:.1f})"
    eight_b = "fitted on" if fit_8b else score(unseen["llama-3-8b"])
    print(f"{name:<58}{score(held_out):>9}{eight_b:>11}{score(unseen['llama-3.1-405b']):>7}  {detail}", flush=True)
    return k


print(f"{'variant':<58}{'held out':>9}{'8B':>11}{'405B':>7}")
run("stored model")
links = protocol_links()
for preset in ("nvlink-h100", "pcie-no-p2p"):
    link = links(preset)
    print(f"  ({preset} as NCCL protocols: LL {link.latency_us:.1f} us + {link.latency_per_rank_us:.2f} us per rank "
          f"beyond 2, bus {link.bandwidth_gbps:.0f} GB/s, LL {min(LL_MAX_BUS_GBPS, link.bandwidth_gbps / 2):.0f} GB/s)")
run("link: the cheapest of NCCL's ring protocols", link_of=links)
run("interference hidden while the transfer is longer", seams={"overlapped": overlap_limited})
run("both", link_of=links, seams={"overlapped": overlap_limited})
for start in (0.5, 2.0, 3.0, 4.5):
    run("interference flat up to a fitted knee", seams={"interference": knee_interference},
        new_constants={"knee_log2": (start, (0.0, 6.0))})
run("the knee, with the 8B speedups in the fit", seams={"interference": knee_interference},
    new_constants={"knee_log2": (2.0, (0.0, 6.0))}, fit_8b=True)
run("link: its own latency at each TP", link_of=latency_per_tp_links())
run("interference the same at every batch size", seams={"interference": flat_interference},
    dropped=("overlap_penalty_growth",))
k = run("the same, but the prefill's own", seams={"interference": flat_interference,
                                                  "prefill_interference": own_prefill_interference},
        new_constants={"prefill_penalty": (0.3, (0.0, 1.0))}, dropped=("overlap_penalty_growth",))
print(f"  (rho {k['overlap_penalty']:.2f} in decode, {k['prefill_penalty']:.2f} in the prefill)")
