"""`ladder serve`: an OpenAI-compatible server for any model ladder runs (`ladder.serve`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ladder.cli.common import add_model_options, decode_step, model_spec
from ladder.comm.distributed import pick_device
from ladder.comm.launch import launch
from ladder.comm.links import link_presets
from ladder.errors import LadderError, Stopped
from ladder.options import API_KEY, DecodeStep, environment_value
from ladder.runtime.limits import check_max_model_len
from ladder.runtime.memory import parse_memory_setting
from ladder.serve.worker import ServeSettings, serve_on_rank



def cmd_serve(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    config = spec.validate()
    for flag, value, least in (("--max-batch", args.max_batch, 1), ("--max-num-batched-tokens", args.max_num_batched_tokens, args.max_batch),
                               ("--max-waiting", args.max_waiting, 0), ("--max-model-len", args.max_model_len or 2, 2),
                               ("--max-prefill-while-decoding", args.max_prefill_while_decoding, 0)):
        if value < least:
            raise LadderError(f"{flag} must be >= {least}, got {value}")
    if config is not None and args.max_model_len:
        check_max_model_len(args.max_model_len, config.max_seq_len)
    if args.interconnect is not None and args.interconnect not in link_presets():
        raise LadderError(f"unknown --interconnect {args.interconnect!r}; known: {', '.join(link_presets())}")
    parse_memory_setting(args.kv_cache_memory)  # its one-line refusal, before any worker starts
    step = serving_step(args, pick_device(spec.device))
    name = args.served_model_name or (Path(args.model).name if args.model else args.preset)
    settings = ServeSettings(spec, name, args.host, args.port, args.max_batch, args.max_model_len, args.max_waiting,
                             args.max_num_batched_tokens, args.shutdown_timeout, args.interconnect, args.link_scale, step,
                             api_key=args.api_key or environment_value(API_KEY) or None,
                             kv_cache_memory=args.kv_cache_memory,
                             max_prefill_while_decoding=args.max_prefill_while_decoding)
    emulated = args.interconnect is not None
    try:
        launch(serve_on_rank, 1 if emulated else spec.tp, settings, device=spec.device, workers_catch_interrupt=True)
    except Stopped:  # SIGTERM to the launcher: it passed it on, and rank 0 shut the server down
        return 0
    return 0


def serving_step(args: argparse.Namespace, device: torch.device) -> DecodeStep:
    """The decode step asked for; without a step flag, compiled layers on a CPU, whose shapes torch's cache
    keeps across starts (SmolLM2's 32 on a 2-core AVX-512 EPYC: 34.6 s at the first start, 1.5 s after),
    ahead of the eager step under a burst and one at a time, level or ahead under arriving prompts
    (docs/serving.md); eager on CUDA and behind an emulated link (not cached: every start would compile)."""
    asked = decode_step(args)
    if asked.captures_cuda_graph and device.type != "cuda":
        raise LadderError("--cuda-graph needs a CUDA device (use --compile or --compile-layers on the CPU)")
    if args.eager:
        if asked is not DecodeStep.EAGER:
            raise LadderError("--eager goes with none of --compile, --compile-layers and --cuda-graph")
        return asked
    if asked is DecodeStep.EAGER and device.type == "cpu" and args.interconnect is None:
        return DecodeStep.COMPILED_LAYERS
    return asked


def add_options(s: argparse.ArgumentParser) -> None:
    """`ladder serve`'s options."""
    add_model_options(s)
    g = s.add_argument_group("server")
    g.add_argument("--host", default=ServeSettings.host)
    g.add_argument("--port", type=int, default=ServeSettings.port)
    g.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (/health and /metrics stay open; "
                   f"default: ${API_KEY}, else none)")
    g.add_argument("--served-model-name", help="the model's name in the API (default: the folder, file or preset name)")
    g.add_argument("--max-batch", type=int, default=ServeSettings.max_batch, help="requests decoded together (KV-cache rows)")
    g.add_argument("--max-model-len", type=int,
                   help="context per request (default: what --max-batch rows fit in the KV-cache budget, up to the "
                   "model's max_seq_len)")
    g.add_argument("--kv-cache-memory", default=ServeSettings.kv_cache_memory,
                   help="the KV cache's budget: a fraction of the memory available at start-up (shared by this "
                   "machine's ranks), or a size such as 4GiB (default: %(default)s)")
    g.add_argument("--max-waiting", type=int, default=ServeSettings.max_waiting,
                   help="queued requests beyond which new ones get 503")
    g.add_argument("--max-num-batched-tokens", type=int, default=ServeSettings.max_num_batched_tokens,
                   help="tokens a step computes: one per running request, the rest prompt chunks (as in vLLM)")
    g.add_argument("--max-prefill-while-decoding", type=int, default=ServeSettings.max_prefill_while_decoding,
                   help="prompt tokens a step carries while other requests decode: each running stream waits for "
                   "them (the inter-token latency's tail); 0: the budget's rest (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=ServeSettings.shutdown_timeout_s,
                   help="seconds requests in flight get to finish after SIGTERM or Ctrl-C")
    g.add_argument("--interconnect", help="an emulated link (one process, rank 0's shard of --tp ranks)")
    g.add_argument("--link-scale", type=float, default=1.0, help="stretch the emulated link's times")
    d = s.add_argument_group("decode step (compiled or graphed at fixed shapes, made before the server answers; "
                             "default: --compile-layers on a CPU, eager on CUDA and with --interconnect)")
    d.add_argument("--eager", action="store_true", help="the eager step: nothing compiled at start-up")
    d.add_argument("--compile", action="store_true", help="torch.compile the whole decode step (CUDA graphs on GPU)")
    d.add_argument("--compile-layers", action="store_true",
                   help="compile each layer's attention and MLP once for all layers, the step between them eager")
    d.add_argument("--cuda-graph", action="store_true",
                   help="capture the decode step (eager, or with --compile-layers) as CUDA graphs (GPU)")
    s.set_defaults(func=cmd_serve)
