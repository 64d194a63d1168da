"""A sweep, checked once: its points (`BenchPoint`, one configuration each) are validated when they are
made (`sweep_points`), and everything that runs them trusts them."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ladder.comm.distributed import pick_device
from ladder.comm.launch import check_launchable, under_torchrun
from ladder.comm.links import LinkModel
from ladder.errors import LadderError
from ladder.model.config import ModelConfig, layout_variants
from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep
from ladder.quant.quantize import check_quantize

INTERLEAVE_MODES = ("runs", "steps")


@dataclass(frozen=True)
class BenchPoint:
    """One configuration of a sweep."""

    preset: str
    layout: str
    tp: int
    batch_size: int
    prompt_len: int
    gen_len: int
    link: LinkModel | None = None  # None: the real interconnect (torch.distributed)
    link_scale: float = 1.0
    comm_share: float | None = None  # link_scale was calibrated for this share of standard's step
    ladder_layers: int | None = None
    warmup: int = 1
    runs: int = 3
    device: str = "auto"
    dtype: str | None = None
    quantize: str | None = None  # "int8" or "int4" weight-only (ladder.quant.quantize)
    decode_step: DecodeStep = DecodeStep.EAGER
    seed: int = 0
    top_k: int = 200
    temperature: float = 0.8
    checkpoint: str | None = None  # a GGUF file, HF folder or short name; None: random weights
    profile_dir: str | None = None  # write a profiler trace of one extra short run here
    profile_tokens: int = 8  # new tokens of that run (the trace of a whole 512-token run is huge)

    @property
    def emulated(self) -> bool:
        return self.link is not None

    def with_dtype_resolved(self) -> BenchPoint:
        """The point with the dtype it will run in (the default depends on the device), as its results
        record it: `--resume` compares points with records."""
        return dataclasses.replace(self, dtype=self.model_spec().dtype_name(pick_device(self.device)))

    def model_spec(self) -> ModelSpec:
        """The model this point measures (random weights are drawn in each rank's shard: see `ModelSpec.load`)."""
        return ModelSpec(preset=self.preset, model=self.checkpoint, layout=self.layout,
                         ladder_layers=self.ladder_layers, tp=self.tp, device=self.device, dtype=self.dtype,
                         seed=self.seed, quantize=self.quantize)

    @property
    def interconnect(self) -> str:
        return self.link.name if self.link else "real"

    def config(self) -> ModelConfig:
        config = self.model_spec().config()
        config.check_tp(self.tp)
        return config

    def describe(self) -> dict[str, Any]:
        """The point's settings as results records keep them (the decode step as its three flags)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "decode_step"}
        d |= self.decode_step.flags()
        d["link"] = self.link.to_dict() if self.link else None
        d["interconnect"] = self.interconnect
        d["emulated"] = self.emulated
        return d


def sweep_points(presets: Sequence[str], layouts: Sequence[str], tps: Sequence[int], batch_sizes: Sequence[int],
                 links: Sequence[LinkModel | None], **common: Any) -> list[BenchPoint]:
    """Every combination, validated up front (unknown names and impossible TP degrees fail at once).
    `ladder_layers` (a list of N): the ladder layout becomes one hybrid per N, ladder on the last N layers.
    Hybrid is a kind of ladder: the other layouts stay whole, the baselines it is compared with."""
    ladder_layers = common.pop("ladder_layers", None)
    points = [BenchPoint(preset=p, layout=layout, tp=tp, batch_size=b, link=link, ladder_layers=n, **common)
              for p in presets for link in links for tp in tps for b in batch_sizes
              for layout, n in layout_variants(layouts, ladder_layers)]
    _check_links(points)
    # an unknown device, or CUDA on a machine without it, fails here
    device_types = {device: pick_device(device).type for device in {p.device for p in points}}
    for point in points:
        _check_point(point, device_types[point.device])
    return points


def _check_links(points: Sequence[BenchPoint]) -> None:
    if under_torchrun():  # the ranks are torchrun's: a real link runs at exactly that many
        world = int(os.environ["WORLD_SIZE"])
        other = sorted({p.tp for p in points if not p.emulated and p.tp != world})
        if other:
            raise LadderError(f"under torchrun (WORLD_SIZE={world}) the real interconnect runs at --tp {world} only, "
                              f"not {', '.join(map(str, other))}; an emulated link (--interconnect NAME) runs any "
                              "--tp on each rank")
    if any(p.link_scale != 1 for p in points) and not any(p.emulated for p in points):
        raise LadderError("--link-scale dilates an emulated link, and --interconnect real has none: "
                          "name one, e.g. --interconnect pcie-no-p2p")


def _check_point(point: BenchPoint, device_type: str) -> None:
    config = point.config()
    check_quantize(point.quantize, device_type, point.model_spec().torch_dtype(torch.device(device_type)))
    if not point.emulated:
        check_launchable(point.tp, device=point.device)
    if point.runs < 1 or point.warmup < 0:
        raise LadderError(f"--runs must be >= 1 and --warmup >= 0, got {point.runs} and {point.warmup}")
    if not (math.isfinite(point.link_scale) and point.link_scale > 0):
        raise LadderError(f"--link-scale must be a positive number, got {point.link_scale:g}")
    if point.decode_step.captures_cuda_graph and device_type != "cuda":
        raise LadderError(f"--cuda-graph needs a CUDA device, and --device {point.device} is {device_type}")
    if point.profile_dir is not None and point.profile_tokens < 1:
        raise LadderError(f"--profile-tokens must be >= 1, got {point.profile_tokens}")
    if point.batch_size < 1 or point.prompt_len < 1 or point.gen_len < 1:
        raise LadderError("batch sizes, --prompt-len and --gen-len must be >= 1")
    if point.prompt_len + point.gen_len > config.max_seq_len:
        raise LadderError(f"--prompt-len {point.prompt_len} + --gen-len {point.gen_len} exceeds "
                          f"{point.preset}'s max_seq_len {config.max_seq_len}")


def check_repetition(rounds: int, interleave: str | None) -> None:
    """Refuse `--rounds` and `--interleave` values a sweep cannot run, before it is announced."""
    if rounds < 1:
        raise LadderError(f"--rounds must be at least 1, got {rounds}")
    if interleave not in (None, *INTERLEAVE_MODES):
        raise LadderError(f"--interleave takes {' or '.join(INTERLEAVE_MODES)}, not {interleave!r}")


def interleaved_groups(points: Sequence[BenchPoint]) -> list[list[BenchPoint]]:
    """Points that differ only in layout, grouped (in sweep order) to be measured together."""
    groups: dict[BenchPoint, list[BenchPoint]] = {}
    for p in points:
        groups.setdefault(dataclasses.replace(p, layout="", ladder_layers=None), []).append(p)
    return list(groups.values())
