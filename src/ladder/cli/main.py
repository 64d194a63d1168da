"""The `ladder` command: its parser, built from each command's module, and the one place where errors
become one line and an exit status (a `LadderError`: `ladder: error: ...`, exit 2)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ladder.console import say
from ladder.errors import LadderError, Stopped, communication_failure, exit_status, stop_message


@dataclass(frozen=True)
class Command:
    module: str  # ladder.cli.<module> holds the command's options and code: a command imports its own only
    adder: str  # the function there that adds its options to its parser
    summary: str  # its line in `ladder --help`


# The others' modules (a server's web stack, the benchmarks') took 0.5 s of every start here, and any
# one of them imports torch (2 s): `ladder --help` and a mistyped command import none.
COMMANDS = {
    "generate": Command("generate", "add_options", "generate text (or ids) with any model, layout and TP degree"),
    "eval": Command("evaluate", "add_options", "perplexity of a model on a text file, or lm-evaluation-harness tasks"),
    "convert": Command("convert", "add_options",
                       "convert a checkpoint to a residual layout, write a Hugging Face folder"),
    "bench": Command("bench", "add_options",
                     "throughput sweep over layouts x TP x batch (see also: ladder bench plot, summary and link)"),
    "predict": Command("predict", "add_options", "predict tokens/s per layout from a roofline + link cost model"),
    "serve": Command("serve", "add_options", "serve a model over the OpenAI API (continuous batching, any TP degree)"),
    "train": Command("train", "add_options",
                     "pretrain from a preset or adapt a checkpoint (see also: ladder train plot)"),
    "train-plot": Command("train", "add_plot_options",
                          "loss curves of runs on one picture (also: ladder train plot RUN...)"),
    "bench-summary": Command("bench", "add_summary_options", "the speedup table of results files, then the "
                             "configurations that failed (also: ladder bench summary FILE...)"),
    "bench-plot": Command("bench", "add_plot_options",
                          "draw the pictures of results files (also: ladder bench plot FILE...)"),
    "bench-link": Command("bench", "add_link_options", "time this machine's all-reduce by message size and fit the "
                          "link model --interconnect custom takes (also: ladder bench link)"),
    "bench-serve": Command("bench_serve", "add_options",
                           "load-test an OpenAI-compatible server (also: ladder bench serve)"),
}


def build_parser(command: str | None = None, with_options: bool = True) -> argparse.ArgumentParser:
    """The parser of `command` alone, where it is one; of every command otherwise. Without options: each
    command's name and summary only, what `ladder --help` and an unknown command need."""
    parser = argparse.ArgumentParser(prog="ladder", description="Ladder-Residual transformers: run, "
                                     "benchmark and convert models with every residual layout.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, spec in COMMANDS.items():
        if command in COMMANDS and command != name:
            continue
        p = sub.add_parser(name, prog=f"ladder {name.replace('-', ' ')}", help=spec.summary, description=spec.summary)
        if with_options:
            getattr(importlib.import_module(f"ladder.cli.{spec.module}"), spec.adder)(p)
            say_defaults(p)
    return parser


def say_defaults(parser: argparse.ArgumentParser) -> None:
    """Make --help name every option's default (argparse prints none, and none for options without help)."""
    for action in parser._actions:
        text = action.help or ""
        no_default = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not no_default and "default" not in text:
            action.help = f"{text} (default: %(default)s)".lstrip()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and f"{argv[0]}-{argv[1]}" in COMMANDS:  # `ladder bench plot` reads better than bench-plot
        argv = [f"{argv[0]}-{argv[1]}", *argv[2:]]
    command = argv[0] if argv else None
    parser = build_parser(command, with_options=command in COMMANDS)
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "train":  # settings may also follow options: --nproc 2 lr=1e-3
        args.overrides += [item for item in unknown if "=" in item and not item.startswith("-")]
        unknown = [item for item in unknown if item not in args.overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except LadderError as exc:
        say(f"ladder: error: {exc}")
        return 2
    except (KeyboardInterrupt, Stopped) as exc:
        say(f"ladder: {stop_message(exc)}")
        return exit_status(exc)
    except RuntimeError as exc:
        said = communication_failure(exc)
        if said is None:
            raise
        say(f"ladder: error: {said}")
        return 1
    except BrokenPipeError:  # output piped into `head` and closed early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # the file system refused (full disk, permissions): the environment, not a bug
        say(f"ladder: error: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        return 1


if __name__ == "__main__":
    sys.exit(main())
