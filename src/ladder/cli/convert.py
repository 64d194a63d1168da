"""`ladder convert`: a checkpoint in another residual layout, written as a Hugging Face folder."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ladder.checkpoint.hf import check_replaceable, save_hf
from ladder.cli.common import info
from ladder.comm.base import LocalCommunicator
from ladder.comm.distributed import pick_device
from ladder.errors import LadderError
from ladder.files import check_room
from ladder.model.config import DESYNC_PATTERNS, LAYOUTS
from ladder.model.spec import LoadedModel, ModelSpec
from ladder.model.weights import export_hf_state_dict
from ladder.train.calibrate import calibrate_stale_inputs, describe
from ladder.train.data import pack, read_texts

CALIBRATION_SEQ_LEN = 256


def cmd_convert(args: argparse.Namespace) -> int:
    spec = ModelSpec(model=args.src, layout=args.layout, ladder_layers=args.ladder_layers,
                     desync_reduce=args.desync_reduce, device="cpu", dtype="float32")
    spec.validate()
    to_ladder = spec.config().layout == "ladder" and spec.config().n_ladder_layers > 0
    if args.calibrate and not to_ladder:
        raise LadderError("--calibrate corrects a ladder conversion's stale inputs: give --ladder-layers N")
    out = Path(args.out).expanduser().resolve()
    check_replaceable(out, args.force)  # before the minutes of loading
    check_room(out.parent, spec.config().n_params() * 4,  # float32 weights
               f"the model folder {out.name}")
    loaded = spec.load(LocalCommunicator(), pick_device("cpu"))
    info(f"ladder: {spec.describe(loaded)}")
    if args.calibrate:
        calibrate(loaded, args)
    elif to_ladder:
        info("ladder: not calibrated: --calibrate TEXT fits each converted module's stale input to the original's "
             "(docs/training.md)")
    path = save_hf(out, loaded.model.config, export_hf_state_dict(loaded.model), loaded.tokenizer, force=args.force)
    print(f"wrote {path} ({loaded.model.config.layout_name})")
    return 0


def calibrate(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Fit the converted modules' stale inputs to the original's on the text of `--calibrate`."""
    if loaded.tokenizer is None:
        raise LadderError(f"{args.src} has no tokenizer to read the calibration text with")
    original = ModelSpec(model=args.src, device="cpu", dtype="float32").load(LocalCommunicator(), pick_device("cpu"))
    sequences = pack(read_texts(args.calibrate), loaded.tokenizer, CALIBRATION_SEQ_LEN)[:, :-1]
    rows = min(len(sequences), math.ceil(args.calibrate_tokens / CALIBRATION_SEQ_LEN))
    spread = sequences[torch.linspace(0, len(sequences) - 1, rows).long()]  # over the whole text, not its start
    fits = calibrate_stale_inputs(loaded.model, original.model, spread)
    info(f"ladder: {describe(fits)}, on {spread.numel():,} tokens of {', '.join(args.calibrate)}")


def add_options(c: argparse.ArgumentParser) -> None:
    """`ladder convert`'s options."""
    c.add_argument("src", help="a GGUF file, a Hugging Face folder, or a short name")
    c.add_argument("--out", required=True, help="the folder to write (atomically)")
    c.add_argument("--ladder-layers", type=int, metavar="N", help="ladder on the last N layers")
    c.add_argument("--layout", help=f"target layout, one of: {', '.join(LAYOUTS)}")
    c.add_argument("--desync-reduce", choices=DESYNC_PATTERNS)
    c.add_argument("--calibrate", nargs="+", metavar="TEXT",
                   help="ladder: fit each converted module's stale input to the original model's, in closed form, "
                        "on this text (files, folders of .txt, shakespeare:train, pydoc, python-source); see docs/training.md")
    c.add_argument("--calibrate-tokens", type=int, default=16384, metavar="N",
                   help="--calibrate: tokens to fit on, spread over the text (default: %(default)s)")
    c.add_argument("--force", action="store_true", help="replace --out if it exists")
    c.set_defaults(func=cmd_convert)
