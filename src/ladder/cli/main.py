"""The `ladder` command: its parser, built from each command's module, and the one place where errors
become one line and an exit status (a `LadderError`: `ladder: error: ...`, exit 2)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ladder.cli import bench, bench_serve, convert, evaluate, generate, predict, serve, train
from ladder.cli.common import exit_status, say_defaults, stop_message
from ladder.comm.distributed import communication_failure, say
from ladder.errors import LadderError, Stopped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladder", description="Ladder-Residual transformers: run, "
                                     "benchmark and convert models with every residual layout.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in (generate.add_parser, evaluate.add_parser, convert.add_parser, bench.add_parser,
                       predict.add_parser, serve.add_parser, train.add_parser, train.add_plot_parser, bench.add_summary_parser,
                       bench.add_plot_parser, bench.add_link_parser, bench_serve.add_parser):
        say_defaults(add_parser(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] in (["bench", "plot"], ["bench", "summary"], ["bench", "link"], ["bench", "serve"], ["train", "plot"]):  # reads better
        argv = [f"{argv[0]}-{argv[1]}", *argv[2:]]
    parser = build_parser()
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
