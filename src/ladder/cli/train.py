"""`ladder train` (pretraining or adaptation, data parallel) and `ladder train plot`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ladder.comm.launch import launch
from ladder.errors import check_creatable
from ladder.train.loop import train
from ladder.train.plot import plot_training
from ladder.train.settings import TrainConfig, load_train_config, settings_help


def train_on_rank(config: TrainConfig, resume: bool, progress: bool) -> dict:
    result = train(config, resume=resume, progress=progress)
    return {"losses": result.losses, "final_dir": str(result.final_dir), "eval_loss": result.eval_loss}


def cmd_train(args: argparse.Namespace) -> int:
    config = load_train_config(args.config, args.overrides)
    check_creatable(Path(config.out_dir) / "metrics.jsonl")  # before the workers start, not after the first steps
    results = launch(train_on_rank, args.nproc, config, args.resume, not args.no_progress, flag="--nproc",
                     device=config.device, workers_catch_interrupt=True)
    result = results.get(0)
    if result:
        eval_text = (f", held-out loss {result['eval_loss']:.4f} (perplexity {math.exp(result['eval_loss']):.2f})"
                     if result["eval_loss"] is not None else "")
        losses = result["losses"]
        last = f"final train loss {losses[-1]:.4f}" if losses else "nothing left to train"
        print(f"{last}{eval_text}; model written to {result['final_dir']}")
    return 0


def cmd_train_plot(args: argparse.Namespace) -> int:
    print(plot_training([Path(r) for r in args.runs], Path(args.out)))
    return 0


def add_options(t: argparse.ArgumentParser) -> None:
    """`ladder train`'s options."""
    t.epilog = settings_help()
    t.add_argument("--config", help="a YAML or TOML file of train settings")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings that override the file")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir")
    t.add_argument("--nproc", type=int, default=1, help="data-parallel workers to start on this machine")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)


def add_plot_options(tp_: argparse.ArgumentParser) -> None:
    """`ladder train plot`'s options."""
    tp_.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl)")
    tp_.add_argument("--out", default="loss.png", help="the picture to write")
    tp_.set_defaults(func=cmd_train_plot)
