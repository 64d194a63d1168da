"""Fitting the cost model's constants to the paper's table, and judging them on what was not fitted:
the held-out batch sizes of the 70B table (`validate`) and the settings never fitted (`validate_unseen`).
The fitted constants are stored in data/costmodel-fit.json by experiments/costmodel/fit.py."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch

from ladder.comm.links import LinkModel, link_presets
from ladder.errors import LadderError
from ladder.model.config import get_preset
from ladder.predict.costmodel import (GPU, GPUS, Constants, CostConstants, LinkOf, Workload, constant_tensors,
                                      constant_values, fitted_constants, predict_seconds_of, predicted_speedup,
                                      stored_fit)
from ladder.predict.paper import P2P_LINKS, UnseenSetting, paper_table, paper_throughputs, unseen_rows

TRAIN_BATCHES = (1, 64)  # fit on the extremes; judge on the batch sizes in between
HELD_OUT_BATCHES = (4, 16)


def _row_workload(r: dict[str, Any]) -> Workload:
    return Workload(get_preset("llama-3-70b"), r["tp"], r["batch_size"], r["prompt_len"], r["gen_len"])


# constants with a range; the others are >= 0
BOUNDS = {"mem_efficiency": (0.05, 1.0), "attention_efficiency": (0.01, 1.0), "flop_efficiency": (0.05, 1.0),
          "overlap_penalty": (0.0, 1.0), "shared_norm_fraction": (0.0, 1.0)}


def _preset_link(name: str) -> LinkModel:
    return link_presets()[name]


def fit(rows: list[dict[str, Any]], gpu: GPU = GPUS["h100"]) -> CostConstants:
    """Least squares on log tokens/s over `rows`, from the default constants."""
    return CostConstants(**fit_constants(rows, asdict(CostConstants()), gpu=gpu))


Residuals = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def log_errors(rows: list[dict[str, Any]], gpu: GPU = GPUS["h100"],
               link_of: LinkOf = _preset_link) -> Residuals:
    """The error of predicted log tokens/s at each row, as a function of the constants (tensors): what
    the fit squares. The rows' workloads and links are looked up once, for the fit's many calls."""
    targets = torch.tensor([math.log(r["tokens_per_s"]) for r in rows], dtype=torch.float64)
    workloads, layouts = [_row_workload(r) for r in rows], [r["layout"] for r in rows]
    links = [link_of(P2P_LINKS[r["p2p"]]) for r in rows]
    tokens = torch.tensor([r["batch_size"] * r["gen_len"] for r in rows], dtype=torch.float64)
    return lambda k: torch.log(tokens / predict_seconds_of(workloads, layouts, gpu, links, k)) - targets


def fit_constants(rows: list[dict[str, Any]], init: Mapping[str, float],
                  bounds: Mapping[str, tuple[float, float]] = BOUNDS, gpu: GPU = GPUS["h100"],
                  link_of: LinkOf = _preset_link, extra_residuals: Residuals | None = None) -> dict[str, float]:
    """The constants that minimise the squared error of log tokens/s over `rows`, within `bounds`,
    starting from `init` (every constant the model reads), each row's link looked up by `link_of`, and
    `extra_residuals(constants)` appended to the rows' if given.

    scipy's bounded trust-region least squares, to convergence, with the model's exact Jacobian
    (autograd). A constant may end on its bound: the fit then says the data want it beyond what is
    physical (docs/costmodel.md). From the default start this reaches the lowest minimum that random
    starts find (`tests/test_costmodel.py`); a few starts end in worse local minima."""
    try:  # scipy: only fitting needs it (the test extra installs it), not `ladder predict`
        from scipy.optimize import least_squares
    except ImportError:
        raise LadderError("fitting the cost model needs scipy: pip install scipy") from None
    names = list(init)
    lower = [bounds.get(name, (0.0, math.inf))[0] for name in names]
    upper = [bounds.get(name, (0.0, math.inf))[1] for name in names]
    errors = log_errors(rows, gpu, link_of)

    def residuals(x: torch.Tensor) -> torch.Tensor:
        k = dict(zip(names, x))
        return errors(k) if extra_residuals is None else torch.cat([errors(k), extra_residuals(k)])

    as_tensor = functools.partial(torch.tensor, dtype=torch.float64)
    result = least_squares(lambda x: residuals(as_tensor(x)).numpy(),
                           [float(init[name]) for name in names],
                           jac=lambda x: torch.autograd.functional.jacobian(residuals, as_tensor(x)).numpy(),
                           bounds=(lower, upper), method="trf", x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12)
    return {name: float(v) for name, v in zip(names, result.x)}


def fit_error(rows: list[dict[str, Any]], constants: Constants) -> float:
    """What `fit` minimises: the mean squared error of log tokens/s over `rows` (H100, link presets)."""
    k = constant_tensors(constants)
    return float((log_errors(rows)(k) ** 2).mean())


def fit_on_paper() -> CostConstants:
    """Fit the constants on the training part of the paper's table (batch sizes 1 and 64)."""
    return fit([r for r in paper_table() if r["batch_size"] in TRAIN_BATCHES])


def score(report: dict[str, Any]) -> str:
    """"7/10": a validation report's points within its tolerance, of all of them."""
    return f"{sum(p['within'] for p in report['points'])}/{len(report['points'])}"


def stored_accuracy(gpu: GPU = GPUS["h100"]) -> str:
    """Two lines on how close the stored fit comes to the paper's speedups (from its validation in
    costmodel-fit.json), printed under every prediction so no table is read as exact; a third for a
    GPU other than the H100 all of them were measured on."""
    stored = stored_fit()
    held_out = stored["validation"]
    worst = max(abs(p["error"]) for p in held_out["points"])
    unseen = " and ".join(f"{score(report)} on {name}" for name, report in stored["unseen"].items())
    lines = (f"accuracy: speedups within {held_out['tolerance']} of the paper's on {score(held_out)} held-out "
             f"llama-3-70b points (worst off by {worst:.2f}),\n"
             f"          {unseen}, never fitted (ladder predict --validate)")
    if gpu != GPUS["h100"]:
        lines += (f"\n          all on H100s; on {gpu.name} the H100's fitted efficiencies and overheads are "
                  "assumed, not measured")
    return lines


def validate(constants: Constants | None = None, tolerance: float = 0.05,
             link_of: LinkOf = _preset_link) -> dict[str, Any]:
    """Predicted vs published ladder/standard speedup at every held-out (TP, batch, P2P) point."""
    constants = constants or fitted_constants()
    by_key = paper_throughputs()
    points = []
    for (layout, tp, b, p2p), std in sorted(by_key.items()):
        if layout != "standard" or b not in HELD_OUT_BATCHES or ("ladder", tp, b, p2p) not in by_key:
            continue
        published = by_key[("ladder", tp, b, p2p)] / std
        w = Workload(get_preset("llama-3-70b"), tp, b)
        predicted = predicted_speedup(w, "ladder", GPUS["h100"], link_of(P2P_LINKS[p2p]), constants)
        points.append({"tp": tp, "batch_size": b, "p2p": p2p, "published": published, "predicted": predicted,
                       "error": predicted - published, "within": abs(predicted - published) <= tolerance})
    within = sum(p["within"] for p in points)
    return {"constants": constant_values(constants), "tolerance": tolerance, "points": points,
            "fraction_within": within / len(points) if points else 0.0,
            "train_batches": TRAIN_BATCHES, "held_out_batches": HELD_OUT_BATCHES}


def validate_unseen(setting: UnseenSetting, constants: Constants | None = None, tolerance: float = 0.05,
                    link_of: LinkOf = _preset_link) -> dict[str, Any]:
    """Predicted vs published speedup over standard where nothing was fitted: how the constants fitted
    on the 70B table at TP <= 8 carry over to another model size or another link."""
    constants = constants or fitted_constants()
    points = []
    for w, layout, p2p, published in unseen_rows(setting):
        link = link_of(setting.links[p2p])
        predicted = predicted_speedup(w, layout, GPUS["h100"], link, constants)
        points.append({"layout": layout, "tp": w.tp, "batch_size": w.batch_size, "p2p": p2p,
                       "interconnect": link.name, "published": published, "predicted": predicted,
                       "error": predicted - published, "within": abs(predicted - published) <= tolerance})
    within = sum(p["within"] for p in points)
    return {"setting": setting.name, "description": setting.description, "tolerance": tolerance, "points": points,
            "fraction_within": within / len(points)}
