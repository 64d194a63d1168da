"""A decode step captured as one CUDA graph and replayed (`--cuda-graph`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladder.model.transformer import Transformer


class CudaGraphStep:
    """The decode step (eager, or with compiled layers) captured once as a CUDA graph, then replayed: one
    launch a step instead of one per kernel. Eager, a 70B shard's 80 layers are ready after one step,
    where compiling the whole step takes minutes per layout. Captured again when the batch or the KV
    cache changes."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: Transformer) -> None:
        self.step, self.model = step, model
        self.key: tuple | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        key = (tuple(token.shape), tuple(input_pos.shape), self.model.max_batch, self.model.max_seq,
               id(self.model.layers[0].attention.kv_cache))
        if key != self.key:
            self._capture(token, input_pos)
            self.key = key
        self.token.copy_(token)
        self.input_pos.copy_(input_pos)
        self.graph.replay()
        return self.logits  # overwritten by the next replay: sample from it first

    def _capture(self, token: torch.Tensor, input_pos: torch.Tensor) -> None:
        self.graph = None  # the previous graph's memory goes back first
        self.token, self.input_pos = token.clone(), input_pos.clone()
        # One step outside the capture makes cuBLAS's handles and workspaces. It writes this position's
        # keys and values, the same ones the replay below writes.
        side = torch.cuda.Stream(token.device)
        side.wait_stream(torch.cuda.current_stream(token.device))
        with torch.cuda.stream(side):
            self.step(self.token, self.input_pos)
        torch.cuda.current_stream(token.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.step(self.token, self.input_pos)
        self.graph = graph
