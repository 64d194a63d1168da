"""The `ladder` command: its parser, built from each command's module, and the one place where errors
become one line and an exit status (a `LadderError`: `ladder: error: ...`, exit 2)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ladder.cli.common import exit_status, say_defaults, stop_message
from ladder.comm.distributed import communication_failure, say
from ladder.errors import LadderError, Stopped


# Each command's parser and code, by the module `ladder.cli.<module>` that holds them: a command imports its
# own module only. The others' (a server's web stack, the benchmarks') took 0.5 s of every start here.
COMMANDS = {"generate": ("generate", "add_parser"), "eval": ("evaluate", "add_parser"),
            "convert": ("convert", "add_parser"), "bench": ("bench", "add_parser"),
            "predict": ("predict", "add_parser"), "serve": ("serve", "add_parser"),
            "train": ("train", "add_parser"), "train-plot": ("train", "add_plot_parser"),
            "bench-summary": ("bench", "add_summary_parser"), "bench-plot": ("bench", "add_plot_parser"),
            "bench-link": ("bench", "add_link_parser"), "bench-serve": ("bench_serve", "add_parser")}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command` alone, where it is one; of every command otherwise (`ladder --help`, a typo)."""
    parser = argparse.ArgumentParser(prog="ladder", description="Ladder-Residual transformers: run, "
                                     "benchmark and convert models with every residual layout.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, adder) in COMMANDS.items():
        if command not in COMMANDS or command == name:
            say_defaults(getattr(importlib.import_module(f"ladder.cli.{module}"), adder)(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and f"{argv[0]}-{argv[1]}" in COMMANDS:  # `ladder bench plot` reads better than bench-plot
        argv = [f"{argv[0]}-{argv[1]}", *argv[2:]]
    parser = build_parser(argv[0] if argv else None)
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
