"""Shared by the scripts that time decode steps of layouts against each other on an emulated link.

Rank 0's TP-4 shard of the llama-160m shape, one process, one thread; the layouts share one set of
weights and take turns step by step in a drawn order, so the machine's drift hits them alike.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.links import get_link
from ladder.model.config import get_preset
from ladder.model.weights import build_model, init_local_shard, share_weights


def decode_in_turns(layouts: Sequence[str], link_name: str, scale: float, steps: int
                    ) -> tuple[list[EmulatedCommunicator], list[torch.nn.Module], list[list[float]]]:
    """(each layout's communicator, its model, its decode step times in s); the first model holds the
    weights. The communicators count the measured steps only."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    comms = [EmulatedCommunicator(get_link(link_name), 4, cpu, scale) for _ in layouts]
    configs = [get_preset("llama-160m").replace(layout=layout) for layout in layouts]
    owner = build_model(configs[0], comms[0], cpu)
    init_local_shard(owner, seed=0)
    models = [owner] + [share_weights(c, comm, owner) for c, comm in zip(configs[1:], comms[1:])]
    token = torch.zeros(1, 1, dtype=torch.long)
    step_s: list[list[float]] = [[] for _ in layouts]
    order = random.Random(0)
    with torch.inference_mode():
        for model in models:
            model.eval().setup_caches(1, 128)
            for pos in range(5):  # warm-up
                model(token, torch.tensor([pos]))
        for comm in comms:
            comm.reset_counters()
        for step in range(steps):
            turns = list(range(len(layouts)))
            order.shuffle(turns)
            for j in turns:
                position = torch.tensor([5 + step % 100])
                start = time.perf_counter()
                models[j](token, position)
                step_s[j].append(time.perf_counter() - start)
    return comms, models, step_s
