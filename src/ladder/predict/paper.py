"""The paper's published numbers, packaged in ladder/data: its Llama-3-70B H100 throughput table, its
speedups for shapes and links the cost model never fits (8B at TP 8, 405B on two nodes), and the
all-reduce timings its table implies, which the two paper link presets are fitted to."""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ladder.comm.links import Collectives, LinkModel, fit_link
from ladder.model.config import get_preset
from ladder.predict.costmodel import Workload

P2P_LINKS = {"on": "nvlink-h100", "off": "pcie-no-p2p"}  # the paper's two conditions


def paper_table() -> list[dict[str, Any]]:
    """The paper's Llama-3-70B H100 throughput rows (tokens/s per layout, TP, batch, P2P)."""
    text = resources.files("ladder").joinpath("data/llama3-70b-h100-throughput.csv").read_text()
    rows = []
    for r in csv.DictReader(text.splitlines()):
        rows.append({"layout": r["layout"].replace("_", "-"), "tp": int(r["tp"]),
                     "batch_size": int(r["batch_size"]), "p2p": r["p2p"], "prompt_len": int(r["prompt_len"]),
                     "gen_len": int(r["gen_len"]), "tokens_per_s": float(r["tokens_per_s"])})
    return rows


def paper_throughputs() -> dict[tuple[str, int, int, str], float]:
    """The paper's tokens/s by (layout, TP, batch, P2P)."""
    return {(r["layout"], r["tp"], r["batch_size"], r["p2p"]): r["tokens_per_s"] for r in paper_table()}


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


def fit_paper_links() -> dict[str, LinkModel]:
    """The link presets of the paper's two conditions (stored in data/paper-links.json)."""
    sources = {"on": "ladder paper, 8x H100 NVLink: NCCL 4 MiB all-reduce + 70B standard-vs-upper-bound "
                     "gaps at batch 1 and 64",
               "off": "ladder paper, 8x H100, NCCL_P2P_DISABLE=1: NCCL 4 MiB all-reduce + 70B gaps at "
                      "batch 1 and 64"}
    return {P2P_LINKS[p2p]: fit_link(P2P_LINKS[p2p], paper_measurements(p2p), source)
            for p2p, source in sources.items()}


@dataclass(frozen=True)
class UnseenSetting:
    """Published speedups over standard that no constant was fitted on, and the link presets that stand
    for the paper's two conditions there (chosen from what the hardware is, not from the errors)."""
    name: str
    csv: str  # in ladder/data: model, tp, batch, lengths, p2p, layout, speedup_over_standard
    links: dict[str, str]  # p2p condition -> link preset
    description: str


UNSEEN_SETTINGS = {setting.name: setting for setting in (
    UnseenSetting(
        "llama-3-8b", "data/llama3-8b-h100-tp8-speedups.csv", {"on": P2P_LINKS["on"]},
        "a shape never fitted: the paper's llama-3-8b speedups over standard, h100 x8, nvlink"),
    # Two nodes of 8: every all-reduce crosses InfiniBand (with P2P) or, with NCCL_P2P_DISABLE=1,
    # also goes through host memory inside each node, the condition pcie-no-p2p was fitted on.
    UnseenSetting(
        "llama-3.1-405b", "data/llama3.1-405b-h100-tp16-speedups.csv",
        {"on": "infiniband-ndr", "off": P2P_LINKS["off"]},
        "a shape and a link never fitted: the paper's llama-3.1-405b speedups, h100 x16 on two nodes,\n"
        "p2p on predicted with infiniband-ndr (a datasheet preset), off with pcie-no-p2p"),
)}


def unseen_rows(setting: UnseenSetting) -> list[tuple[Workload, str, str, float]]:
    """The setting's published points: (workload, layout, p2p condition, speedup over standard)."""
    text = resources.files("ladder").joinpath(setting.csv).read_text()
    return [(Workload(get_preset(r["model"]), int(r["tp"]), int(r["batch_size"]), int(r["prompt_len"]),
                      int(r["gen_len"])), r["layout"], r["p2p"], float(r["speedup_over_standard"]))
            for r in csv.DictReader(text.splitlines())]
