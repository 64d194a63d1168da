"""Run a function on N tensor-parallel workers: under torchrun as is, or by starting N local
processes with torch's own elastic launcher (what `torchrun --standalone` does).

CPU workers are forked from a fork server that has imported torch once (where the platform has one):
a fresh worker then starts without importing torch again, which a sweep would otherwise pay for every
configuration. GPU workers are spawned.

When one rank fails, the launcher stops every other rank and `launch` raises a one-line
`LadderError` naming the failed rank and its error; nothing hangs.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import traceback
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ladder.errors import LadderError, Stopped
from ladder.options import LAUNCHED_WORKER, environment_value

T = TypeVar("T")
# Set for the processes `launch` starts, the fork server included: Ctrl-C ends them silently while
# they import (read in ladder/__init__.py); each worker then sets its own handling (`_worker`).
WORKER_ENV = LAUNCHED_WORKER
# What a fork server imports once for all its workers: the heavy part of every worker's start-up.
# (torch._dynamo: functional collectives and custom ops import it at their first call, 2.5 s on a small CPU.)
FORK_SERVER_PRELOAD = ["ladder", "torch", "torch.distributed", "torch._dynamo", "ladder.comm.launch",
                       "ladder.model.transformer", "ladder.runtime.engine", "ladder.bench.worker", "ladder.train.loop"]
# This module's environment when it was imported: in a fork server's worker, the fork server's (see
# `_adopt_environment`).
_ENVIRONMENT_AT_IMPORT = dict(os.environ)
# torch's c10d rendezvous, under a name of ours so that `launch` holds the handler it makes (below).
RENDEZVOUS_BACKEND = "ladder-c10d"
_rendezvous_of_this_launch: list[RendezvousHandler] = []


class _RendezvousBackend(dynamic_rendezvous.RendezvousBackend):
    """torch's c10d backend, by our name (the registry checks that a handler's backend has the name asked for)."""

    def __init__(self, c10d: dynamic_rendezvous.RendezvousBackend) -> None:
        self._c10d = c10d

    @property
    def name(self) -> str:
        return RENDEZVOUS_BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        return self._c10d.get_state()

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        return self._c10d.set_state(state, token)


def _create_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    c10d, store = c10d_rendezvous_backend.create_backend(params)
    handler = dynamic_rendezvous.create_handler(store, _RendezvousBackend(c10d), params)
    _rendezvous_of_this_launch.append(handler)
    return handler


rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _create_rendezvous)


def quiet_when_the_launcher_is_gone(kind: type[BaseException], value: BaseException,
                                    tb: types.TracebackType | None) -> None:
    """`sys.excepthook` of the processes `launch` starts. A worker that the fork server forks after the
    launching process was stopped (Ctrl-C while the workers start) finds the launcher's semaphores and
    pipes gone while it unpickles its start-up data, in multiprocessing's `spawn._main`: it exits
    silently (status 1), and the launching process alone reports the stop. Any other error prints."""
    frames = [(frame.f_code.co_filename, frame.f_code.co_name) for frame, _ in traceback.walk_tb(tb)]
    starting = any(name == "_main" and Path(file).match("multiprocessing/spawn.py") for file, name in frames)
    if not (starting and issubclass(kind, (FileNotFoundError, EOFError, ConnectionError))):
        sys.__excepthook__(kind, value, tb)


if environment_value(WORKER_ENV) == "1":  # (the fork server imports this module before it forks a worker)
    sys.excepthook = quiet_when_the_launcher_is_gone


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher that sets its environment)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _set_cpu_threads(local_world_size: int) -> None:
    # N ranks on one host would each use every core; share them instead (torchrun sets OMP=1).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def _start_method() -> str:
    # On a GPU machine, spawn: a fork server's imports might initialise the CUDA driver, which its
    # forked workers then could not use, and a GPU worker's start-up is dominated by CUDA anyway.
    if "forkserver" not in multiprocessing.get_all_start_methods() or torch.cuda.is_available():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORK_SERVER_PRELOAD)  # (once started: no-op)
    return "forkserver"


def _adopt_environment(launcher_environment: dict[str, str]) -> None:
    """A fork server keeps the environment it started with (the launcher's at its first launch); give
    the worker the launcher's environment of now, plus what the elastic agent set for this rank."""
    set_for_rank = {k: v for k, v in os.environ.items() if _ENVIRONMENT_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_environment)
    os.environ.update(set_for_rank)


def _worker(fn: Callable[..., T], error_dir: str, quietly: bool, environment: dict[str, str],
            args: tuple[Any, ...]) -> T:
    # A forked worker inherits the fork server's SIGINT handler, whichever launch started that server.
    signal.signal(signal.SIGINT, signal.SIG_DFL if quietly else signal.default_int_handler)
    _adopt_environment(environment)
    rank = int(os.environ.get("RANK", "0"))
    _set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        return fn(*args)
    except BaseException as exc:  # report every failure to the parent, then exit non-zero
        if isinstance(exc, (KeyboardInterrupt, Stopped)):  # the launcher passes the stop on: not again
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_IGN)
        explained = isinstance(exc, (LadderError, KeyboardInterrupt, Stopped))  # (a stop may say what it saved)
        message = str(exc) if explained else f"{type(exc).__name__}: {exc}"
        Path(error_dir, f"rank{rank}").write_text(message.strip().splitlines()[-1] if message.strip() else
                                                  type(exc).__name__)
        if not explained:
            traceback.print_exc()
        raise SystemExit(1)


def check_launchable(nproc: int, flag: str = "--tp", device: str | None = None) -> None:
    """Refuse a local launch this machine cannot hold: one GPU per rank, or a few ranks per CPU core.
    `device` as the command's --device: ranks run on the GPUs unless it is cpu (or there are none)."""
    if nproc < 1:
        raise LadderError(f"{flag} must be >= 1, got {nproc}")
    if under_torchrun():
        return
    cpus = os.cpu_count() or 1
    on_gpus = torch.cuda.is_available() and (device or "auto") != "cpu"
    if not on_gpus and nproc > 8 * cpus:
        raise LadderError(f"{flag} {nproc} needs {nproc} processes; this machine has {cpus} CPU cores "
                          f"(at most {8 * cpus} ranks can be launched here)")
    if on_gpus and nproc > torch.cuda.device_count():
        on_cpu = "device=cpu" if flag == "--nproc" else "--device cpu"  # train takes settings, the rest options
        raise LadderError(f"{flag} {nproc} needs {nproc} GPUs; this machine has {torch.cuda.device_count()}"
                          f" ({on_cpu} runs the ranks on its CPU cores)")


def launch(fn: Callable[..., T], nproc: int, *args: Any, isolate: bool = False, flag: str = "--tp",
           device: str | None = None, workers_catch_interrupt: bool = False) -> dict[int, T]:
    """Run `fn(*args)` on `nproc` ranks and return {rank: result}.

    Under torchrun the current process is one rank: `fn` runs once here and the dict has one entry.
    `fn` must be a module-level function (it is pickled to the workers) and sets up its own process group
    with `ladder.comm.distributed.init_distributed()`. `isolate`: run even a single rank in a fresh
    process (clean peak-memory readings, and a crash or out-of-memory kill cannot take us down).
    `flag`: the option that asked for `nproc` ranks, as errors name it; `device`: the command's --device
    (`check_launchable`). On Ctrl-C the workers end at
    once and silently, unless `workers_catch_interrupt`: then `fn` gets KeyboardInterrupt (training
    saves a checkpoint, and handles SIGTERM too), and what it raises with says what it did.
    """
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc not in (1, world):
            raise LadderError(f"{flag} {nproc} disagrees with torchrun's WORLD_SIZE={world}")
        return {int(os.environ["RANK"]): fn(*args)}
    if nproc == 1 and not isolate:
        return {0: fn(*args)}
    check_launchable(nproc, flag, device)

    # The launcher's own log lines ("Received 2 death signal, shutting down workers") repeat what
    # `launch` reports in one line. Each of its modules sets its logger's level, so set them all.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend=RENDEZVOUS_BACKEND, rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method=_start_method())
    # A worker stopped by a signal may still write its report while this process removes the folder: that
    # must not print at exit.
    with (tempfile.TemporaryDirectory(prefix="ladder-launch-", ignore_cleanup_errors=True) as error_dir,
          _signals_stop_workers()):
        try:
            return elastic_launch(config, _worker)(fn, error_dir, not workers_catch_interrupt, dict(os.environ), args)
        except ChildFailedError as exc:
            raise LadderError(_describe_failure(Path(error_dir), exc)) from None
        except SignalException as exc:  # the launcher has passed it on to the workers, waited up to 30 s
            _shut_down_rendezvous()
            reports = sorted(Path(error_dir).glob("rank*"))
            said = reports[0].read_text() if reports else ""
            if exc.sigval == signal.SIGINT:
                raise KeyboardInterrupt(said) from None
            raise Stopped(exc.sigval, said.removeprefix(f"stopped by {signal.Signals(exc.sigval).name}: ")) from None
        finally:  # (the launcher has shut down the handlers of every other outcome)
            _rendezvous_of_this_launch.clear()


def _shut_down_rendezvous() -> None:
    """After a signal torch's launcher leaves its rendezvous open (for a restart), its keep-alive thread
    running. If that thread held the handler's last reference, the handler would be freed on it, and its
    finalizer's `join` of that same thread prints a RuntimeError traceback after the stop line."""
    for handler in _rendezvous_of_this_launch:
        with contextlib.suppress(RuntimeError):  # (torch's store errors; the stop is what gets reported)
            handler.shutdown()


@contextlib.contextmanager
def _signals_stop_workers() -> Iterator[None]:
    """While workers run, torch's launcher turns a signal to this process into `SignalException` after
    stopping them, and Ctrl-C ends processes still importing silently (see WORKER_ENV). Afterwards
    this process's own signal handlers come back: the launcher leaves its handlers installed, which
    would raise that exception anywhere later on (between two configurations of a sweep, say)."""
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    in_main_thread = threading.current_thread() is threading.main_thread()  # (the launcher checks too)
    before = {s: signal.getsignal(s) for s in handled} if in_main_thread else {}
    os.environ[WORKER_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(WORKER_ENV, None)
        for s, handler in before.items():
            signal.signal(s, handler)


def _describe_failure(error_dir: Path, exc: Exception) -> str:
    # A rank's own error beats the "connection closed by peer" its death causes on the other ranks
    # (which may be written first, as the failing rank tears down its process group on the way out).
    reports = sorted(error_dir.glob("rank*"),
                     key=lambda p: (_is_peer_failure(p.read_text()), p.stat().st_mtime_ns))
    if not reports:
        failures = getattr(exc, "failures", {})
        ranks = ", ".join(str(r) for r in sorted(failures)) or "?"
        return f"worker rank(s) {ranks} died without an error message (killed, or out of memory?)"
    first = reports[0]
    return f"rank {first.name[4:]} failed: {first.read_text()}"


def _is_peer_failure(message: str) -> bool:
    return any(s in message for s in ("by peer", "remote worker", "Connection reset", "Broken pipe"))
