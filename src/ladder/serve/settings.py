"""What `ladder serve` is asked to serve, and how: its settings, apart from the server that reads them
(`ladder.serve.worker`), so that the command line reads its defaults without importing the server."""

from __future__ import annotations

from dataclasses import dataclass, field

from ladder.model.spec import ModelSpec
from ladder.options import DecodeStep


@dataclass(frozen=True)
class ServeSettings:
    model: ModelSpec
    name: str  # the model's name in the API
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_model_len: int | None = None  # default: what fits the KV-cache budget, up to the model's max_seq_len
    max_waiting: int = 256
    max_num_batched_tokens: int = 2048  # one token per running request, the rest prompt chunks (vLLM's CPU default)
    shutdown_timeout_s: float = 10.0
    interconnect: str | None = None  # an emulated link: one process, rank 0's shard
    link_scale: float = 1.0
    decode_step: DecodeStep = DecodeStep.EAGER  # compiled or CUDA-graphed: fixed shapes, made at start-up
    kv_cache_memory: str = "0.15"  # the KV cache's budget: a fraction of the memory available, or a size
    api_key: str | None = field(default=None, repr=False)  # required on /v1/* when set; never printed
    max_prefill_while_decoding: int = 0  # prompt tokens a step carries while requests decode (0: the budget's rest)
