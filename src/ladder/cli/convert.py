"""`ladder convert`: a checkpoint in another residual layout, written as a Hugging Face folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ladder.checkpoint.hf import check_replaceable, save_hf
from ladder.cli.common import info
from ladder.comm.base import LocalCommunicator
from ladder.comm.distributed import pick_device
from ladder.files import check_room
from ladder.model.config import DESYNC_PATTERNS, LAYOUTS
from ladder.model.spec import ModelSpec
from ladder.model.weights import export_hf_state_dict


def cmd_convert(args: argparse.Namespace) -> int:
    spec = ModelSpec(model=args.src, layout=args.layout, ladder_layers=args.ladder_layers,
                     desync_reduce=args.desync_reduce, device="cpu", dtype="float32")
    spec.validate()
    out = Path(args.out).expanduser().resolve()
    check_replaceable(out, args.force)  # before the minutes of loading
    check_room(out.parent, spec.config().n_params() * 4,  # float32 weights
               f"the model folder {out.name}")
    loaded = spec.load(LocalCommunicator(), pick_device("cpu"))
    info(f"ladder: {spec.describe(loaded)}")
    path = save_hf(out, loaded.model.config, export_hf_state_dict(loaded.model), loaded.tokenizer, force=args.force)
    print(f"wrote {path} ({loaded.model.config.layout_name})")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """`ladder convert`'s options."""
    c = sub.add_parser("convert", help="convert a checkpoint to a residual layout, write a Hugging Face folder")
    c.add_argument("src", help="a GGUF file, a Hugging Face folder, or a short name")
    c.add_argument("--out", required=True, help="the folder to write (atomically)")
    c.add_argument("--ladder-layers", type=int, metavar="N", help="ladder on the last N layers")
    c.add_argument("--layout", help=f"target layout, one of: {', '.join(LAYOUTS)}")
    c.add_argument("--desync-reduce", choices=DESYNC_PATTERNS)
    c.add_argument("--force", action="store_true", help="replace --out if it exists")
    c.set_defaults(func=cmd_convert)
    return c
