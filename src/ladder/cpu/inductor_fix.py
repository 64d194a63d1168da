"""A fix for torch inductor's CPU fusion, which can read a custom op's output before the op writes it.

A custom op that writes its result into a tensor it is given (`Tensor(a!) out`: vLLM's `onednn_mm`,
every linear layer on vLLM's CPU backend; ladder's own `ladder::wait_after`) leaves the buffer with two
names in inductor's scheduler: the real one, which the kernels load from, and a new name for the
value after the write, which the readers depend on. `SchedulerNode.recompute_size_and_body` (the CPP
backend calls it to align the loops of two nodes it may fuse) rebuilds a node's reads from its loop
body, under the real names, and renames them back only if the node also has a StarDep or WeakDep.
A node that reads the result then depends on the buffer's allocation instead of the op, and a later
fusion can place it before the op: its kernel reads memory that the op has not written yet.

A ladder model meets this where a standard one does not: its residual add reads module j's output one
module later, beside the next norm, and the CPP backend fuses the two. Found on torch 2.13 (vLLM 0.32's
CPU build): compiled by vLLM, a 5-layer ladder gave wrong logits, a 30-layer one wrong tokens, a
different token on each run once the stale buffer was reused. `tests/test_inductor_fix.py` has the
40-line reproduction, without vLLM. The fix renames the rebuilt reads always, as
`SchedulerNode.refresh_dependencies` already does; renaming twice changes nothing, so it is safe on a
torch that has fixed this.
"""

from __future__ import annotations

import functools
from typing import Any


def keep_mutation_renames() -> None:
    """Install the fix in this process (idempotent). Call before the first compile that needs it."""
    from torch._inductor.scheduler import SchedulerNode

    recompute = SchedulerNode.recompute_size_and_body
    if getattr(recompute, "ladder_fix", False):
        return

    @functools.wraps(recompute)
    def recompute_keeping_renames(self: SchedulerNode, *args: Any, **kwargs: Any) -> None:
        recompute(self, *args, **kwargs)
        self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    recompute_keeping_renames.ladder_fix = True  # type: ignore[attr-defined]
    SchedulerNode.recompute_size_and_body = recompute_keeping_renames  # type: ignore[method-assign]
