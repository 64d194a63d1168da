"""The ladder recurrence: which module output each module reads, and where each all-reduce is waited for.

One function for ladder's own model (`ladder.model.transformer`) and the vLLM plugin
(`ladder.vllm_plugin.model`), so that the two cannot drift apart. The remote code written into converted
folders (`ladder.remote_code`) must import nothing of ladder's, so it keeps its own copy, tested equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ladder.comm.base import Communicator, Done, Handle

ModuleStep = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
"""step(r, arrived): the stream r plus `arrived` (the output the layout adds here; None or zeros when none
is due), and this rank's partial output of the module applied to that sum."""


def ladder_residual(r: torch.Tensor, modules: Iterable[tuple[int, ModuleStep]], comm: Communicator,
                    first_ladder_module: int, n_modules: int, nothing: torch.Tensor | None,
                    pending: list[Handle] | None = None, hand_on: int = 0) -> tuple[torch.Tensor, list[Handle]]:
    """Standard, ladder and hybrid: module j reads r_{j-1} (standard) or r_{j-2} (ladder, j >=
    `first_ladder_module`), for the modules (j, step) in execution order, of `n_modules` in the model.

    standard module:                       ladder module (AR of y_j overlaps h_{j+1}):
        r ----> h_j --AR--> (+) --> r         r_{j-2} --> h_j --AR_async ............
        |                    ^                r_{j-1} --> h_{j+1} --AR_async .....  :
        +--------------------+                          wait(y_j); r_j = r_{j-1} + y_j
                                                        h_{j+2}(r_j) ...

    `pending` holds the handles of outputs not yet added to r, oldest first (a pipeline stage starts with
    the one its predecessor handed on). Before a ladder module all but the newest are waited on and added
    (so it reads r_{j-2}, and the newest all-reduce keeps running while this module computes); before a
    standard module all are. That is at most one output a module: the step adds it, or `nothing` (zeros
    keep one compiled graph for every layer). A hybrid model is this loop with ladder modules only in its
    last N layers: the first ladder attention then reads the residual without the previous (standard)
    layer's MLP, so that MLP's all-reduce, like a ladder module's, runs while the attention computes.
    At the end all but `hand_on` outputs are added (a pipeline stage hands the newest on, unadded).
    Returns the stream and the handles handed on.
    """
    pending = list(pending or ())
    y = None  # the newest module's output: the compute a wait must come after
    # The modules whose output the next module does not wait for: every ladder one, and the last standard
    # one before them (none in a standard model: n_modules is past its last module).
    first_overlapped = first_ladder_module - 1 if first_ladder_module < n_modules else n_modules
    for j, module in modules:
        stale = j >= first_ladder_module
        arrived = pending.pop(0).wait(after=y) if len(pending) > (1 if stale else 0) else nothing
        r, y = module(r, arrived)  # y: this rank's partial sum
        pending.append(comm.all_reduce_async(y) if j >= first_overlapped else Done(comm.all_reduce(y)))
    while len(pending) > hand_on:  # only the last all-reduce is exposed
        r = r + pending.pop(0).wait(after=y)
    return r, pending
