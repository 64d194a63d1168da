"""Shared test helpers: a recording communicator, the unoptimised ladder recurrence, TP workers, the CLI."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ladder.bench.serve_load import descendants, free_port, wait_until_healthy  # noqa: F401 (descendants: for the tests)
from ladder.cli.main import main
from ladder.comm.base import Communicator, Handle, LocalCommunicator
from ladder.comm.distributed import init_distributed, shutdown_distributed
from ladder.errors import LadderError
from ladder.model.config import ModelConfig, get_preset
from ladder.model.transformer import Transformer
from ladder.model.weights import random_model
from ladder.quant.quantize import quantize_shard

CPU = torch.device("cpu")


def ladder_cli(*args: str, timeout: float = 300, dist_timeout_s: int | None = None) -> subprocess.CompletedProcess:
    """`ladder ARGS...` in a fresh interpreter, output captured; `dist_timeout_s`: its process groups' timeout
    (LADDER_DIST_TIMEOUT), for the workers a command starts."""
    env = {**os.environ, "LADDER_DIST_TIMEOUT": str(dist_timeout_s)} if dist_timeout_s else None
    return subprocess.run([sys.executable, "-m", "ladder", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def ladder_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI run in this process, as `ladder_cli` reports it, for a command that starts no workers (or
    whose workers print nothing the test reads): no interpreter and torch start-up (seconds each)."""
    capsys.readouterr()
    code = _exit_code(args)
    said = capsys.readouterr()
    return subprocess.CompletedProcess(["ladder", *args], code, said.out, said.err)


def ladder_in_fixture(*args: str) -> subprocess.CompletedProcess:
    """`ladder_in_process` for a module's fixture, which has no capsys: the output captured by redirection."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _exit_code(args)
    return subprocess.CompletedProcess(["ladder", *args], code, out.getvalue(), err.getvalue())


def _exit_code(args: Sequence[str]) -> int | str | None:
    try:
        return main(list(args))
    except SystemExit as exc:  # argparse refuses an option this way
        return exc.code


def torchrun_ladder(*args: str, dist_timeout_s: int = 60, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 -m ladder ARGS...`, output captured."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run([*torchrun, "-m", "ladder", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "LADDER_DIST_TIMEOUT": str(dist_timeout_s), "OMP_NUM_THREADS": "1"})


# torchrun's agents meet at an exit barrier once their workers end. A known race on the store that
# barrier runs on (pytorch/pytorch#69520) leaves, now and then, one agent waiting out the barrier's
# 300 s timeout after every worker has finished (seen once here, at node 0): it then exits 0. The
# two-node runs wait past that, so torch's race cannot fail them; what stays stuck is killed, workers too.
TWO_NODE_TIMEOUT_S = 360


def start_two_nodes(args_of_node: Sequence[Sequence[str]], cwd_of_node: Sequence[Path | None] = (None, None),
                    dist_timeout_s: int = 60) -> list[subprocess.Popen]:
    """One torchrun agent per node (both on localhost), one rank each, running `ladder ARGS` of its node."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                              "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                              "-m", "ladder", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "LADDER_DIST_TIMEOUT": str(dist_timeout_s),
                                                "OMP_NUM_THREADS": "1"})
            for node, (args, cwd) in enumerate(zip(args_of_node, cwd_of_node, strict=True))]


def torchrun_on_two_nodes(args_of_node: Sequence[Sequence[str]], cwd_of_node: Sequence[Path | None] = (None, None),
                          dist_timeout_s: int = 60, timeout: float = TWO_NODE_TIMEOUT_S) -> list[tuple[int, str, str]]:
    """`ladder ARGS...` as on two machines: one torchrun agent per node (here both on localhost), one
    rank each, so every rank is LOCAL_RANK 0 and each node may have its own command line and folder.
    Returns each node's (status, stdout, stderr); fails with both nodes' output if either is still
    running after `timeout` seconds (their agents and workers are killed)."""
    nodes = start_two_nodes(args_of_node, cwd_of_node, dist_timeout_s)
    deadline = time.monotonic() + timeout
    try:
        outputs = [node.communicate(timeout=max(deadline - time.monotonic(), 0.1)) for node in nodes]
    except subprocess.TimeoutExpired:
        stuck = [pid for node in nodes for pid in [node.pid, *descendants(node.pid)]]  # (workers: own sessions)
        for pid in stuck:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        said = [f"node {rank} (status {node.wait()}):\n{node.communicate()[1][-3000:]}"
                for rank, node in enumerate(nodes)]
        raise AssertionError(f"two torchrun nodes still running after {timeout:g} s\n" + "\n".join(said)) from None
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outputs)]


STEP_FLAGS = ("--eager", "--compile", "--compile-layers", "--cuda-graph")


class Server:
    """`ladder serve ARGS` on a free port, ready when /health says 200; eager unless ARGS name a decode step
    (the CPU's default compiles layers at start-up: a test asks for that where it tests it)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_s: float = 180,
                 api_key: str = "none") -> None:
        for attempt in range(3):  # a free port can be taken before the server binds it (by gloo's own, say)
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.marker = uuid.uuid4().hex  # finds this server's worker processes
            step = [] if any(flag in args for flag in STEP_FLAGS) else ["--eager"]
            command = [sys.executable, "-m", "ladder", "serve", *args, *step, "--port", str(self.port)]
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         env={**os.environ, "LADDER_TEST_SERVER": self.marker, **(env or {})})
            try:
                wait_until_healthy(self.url, [self.proc], startup_s)
                break
            except LadderError as exc:
                self.stop()
                said = self.proc.stderr.read()
                if "address already in use" not in said or attempt == 2:
                    raise AssertionError(f"{exc}: {said}") from None
        import openai  # (the server's tests' client: only they pay for its import)

        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def metric(self, name: str, **labels: str) -> float:
        import httpx

        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def ladder_lines(stderr: str, prefix: str = "ladder:") -> list[str]:
    """What ladder itself said on stderr ("ladder: ..."), without torchrun's and torch's lines."""
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


def has_loaded_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except FileNotFoundError:
        return False


def stop_when_ready(args: list[str], ready: Callable[[int], bool], sig: int, timeout: float = 90) -> tuple[int, str]:
    """Start `ladder ARGS...` in a session of its own, wait until `ready(its pid)`, then send `sig` as a
    terminal or a scheduler would: Ctrl-C to the whole process group, anything else to the command.
    Returns its exit status and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "ladder", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr


def python_docs_corpus(folder: Path, train_chars: int, heldout_chars: int) -> Path:
    """A corpus folder (train.txt, heldout.txt) cut from Python's documentation prose."""
    from ladder.corpora import python_docs_text

    text = python_docs_text()
    (folder / "train.txt").write_text(text[:train_chars])
    (folder / "heldout.txt").write_text(text[200_000:200_000 + heldout_chars])
    return folder


def tiny(**changes) -> ModelConfig:
    return get_preset("tiny").replace(**changes) if changes else get_preset("tiny")


# Weight-only quantization's error on logits, relative (Frobenius), reasoned for Gaussian weights: int8's
# per-row step is max|w| / 127 (about 2.6 sigma / 127 on rows of 64 to 160), a uniform error of about
# 0.6 % of sigma; int4's asymmetric step over a group of 32 is its range / 15 (about 4 sigma / 15), about 8 %.
# The tiny model's logits measured 0.5 % (int8) and 6 % (int4), 0.8 % and 6.4 % in bf16; the bounds leave
# a factor of two or more, and a wrong scale, a transposed group or other weights give errors of order 1.
INT8_RELATIVE_ERROR = 0.02
INT4_RELATIVE_ERROR = 0.15


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def make_model(config: ModelConfig, comm: Communicator | None = None, seed: int = 0,
               shard_vocab: bool = False, quantize: str | None = None) -> Transformer:
    model = random_model(config, comm or LocalCommunicator(), CPU, seed=seed, shard_vocab=shard_vocab).eval()
    quantize_shard(model, quantize)  # this rank's shard, after sharding (as ModelSpec.load does)
    return model


class RecordingCommunicator:
    """Wraps a communicator and records the schedule: which module computes when, and when each
    all-reduce is launched and waited on. Module j's computation is recorded by the norm it starts with."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.events: list[tuple[str, int]] = []
        self._launched = 0

    def attach(self, model: Transformer) -> None:
        for i, layer in enumerate(model.layers):
            layer.attention_norm.register_forward_pre_hook(lambda *_, j=2 * i: self.events.append(("compute", j)))
            if layer.ffn_norm is not None:
                layer.ffn_norm.register_forward_pre_hook(lambda *_, j=2 * i + 1: self.events.append(("compute", j)))

    def _next(self) -> int:
        self._launched += 1
        return self._launched - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        j = self._next()
        self.events.append(("launch", j))
        out = self.inner.all_reduce(x)
        self.events.append(("wait", j))
        return out

    def all_reduce_async(self, x: torch.Tensor) -> Handle:
        j = self._next()
        self.events.append(("launch", j))
        inner = self.inner.all_reduce_async(x)
        events = self.events

        class _Recorded:
            def wait(self, after: torch.Tensor | None = None) -> torch.Tensor:
                events.append(("wait", j))
                return inner.wait(after)

        return _Recorded()

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.all_gather_last_dim(x)


def overlapped_modules(events: list[tuple[str, int]]) -> list[bool]:
    """For each module j with a successor: did module j+1 start computing before AR(y_j) was waited on?"""
    index = {event: i for i, event in enumerate(events)}
    n = max(j for kind, j in events if kind == "compute") + 1
    return [index[("compute", j + 1)] < index[("wait", j)] for j in range(n - 1)]


def in_flight_at_each_wait(events: list[dict], launch: str, waits: tuple[str, ...],
                           blocking: tuple[str, ...] = ()) -> list[int]:
    """From a profiler trace: how many collectives were launched and not yet waited on when each wait
    began. Counted from the first launch, on the outermost events (the profiler nests an op's
    implementation in the op, and a wait op may call another wait inside). A `blocking` op is a
    collective that returns its result reduced (launched and waited on at once): a wait, with itself in
    flight."""
    ops = sorted((e for e in events if e.get("name") in (launch, *waits, *blocking) and e.get("ph") == "X"),
                 key=lambda e: e["ts"])
    ops = ops[next(i for i, e in enumerate(ops) if e["name"] in (launch, *blocking)):]
    outermost = [e for i, e in enumerate(ops) if not any(o["ts"] + o["dur"] >= e["ts"] + e["dur"] for o in ops[:i])]
    in_flight, counts = 0, []
    for e in outermost:
        if e["name"] == launch:
            in_flight += 1
        elif e["name"] in blocking:
            counts.append(in_flight + 1)
        else:
            counts.append(in_flight)
            in_flight -= 1
    return counts


def reference_ladder_logits(model: Transformer, tokens: torch.Tensor, n_ladder: int) -> torch.Tensor:
    """The recurrence of layouts.md written directly: y_j = h_j(r_{j-2}) for ladder modules
    (h_j(r_{j-1}) for standard ones), r_j = r_{j-1} + y_j, with r_0 = r_{-1} = embed. TP=1 only."""
    L = model.config.n_layers
    x = model.tok_embeddings(tokens)
    rope = model.rope(torch.arange(tokens.shape[1])[None], x.dtype)
    modules = []
    for layer in model.layers:
        modules.append(lambda r, layer=layer: layer.attention_branch(r, rope, None, None))
        modules.append(layer.mlp_branch)
    r = {-1: x, 0: x}
    for j in range(1, 2 * L + 1):
        is_ladder = (j - 1) // 2 >= L - n_ladder
        y = modules[j - 1](r[j - 2] if is_ladder else r[j - 1])
        r[j] = r[j - 1] + y
    return model.output(model.norm(r[2 * L]))


def cached_logits(model: Transformer, prompt: torch.Tensor, decode_tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill logits (B, T, V), then one (B, 1, V) per teacher-forced decode token column."""
    B, T = prompt.shape
    model.setup_caches(B, T + decode_tokens.shape[1])
    with torch.inference_mode():
        out = [model(prompt, torch.arange(T))]
        for i in range(decode_tokens.shape[1]):
            out.append(model(decode_tokens[:, i:i + 1], torch.tensor([T + i])))
    return out


def tp_worker(cases: list[tuple[ModelConfig, bool, str | None]], prompt: torch.Tensor, decode_tokens: torch.Tensor
              ) -> dict[str, object]:
    """Runs on each TP rank: cached logits of every case (config, shard_vocab, quantize), plus the
    recorded schedules of ladder, standard and hybrid models, and of ladder quantized."""
    ctx = init_distributed("cpu", timeout_s=120)
    try:
        comm = ctx.communicator()
        logits = [cached_logits(make_model(config, comm, shard_vocab=sv, quantize=q), prompt, decode_tokens)
                  for config, sv, q in cases]
        schedules = {}
        for name, config, quantize in [("ladder", tiny(layout="ladder"), None), ("standard", tiny(), None),
                                       ("hybrid", tiny(layout="ladder", ladder_layers=2), None),
                                       ("ladder int4", tiny(layout="ladder", ffn_hidden=128), "int4")]:
            recorder = RecordingCommunicator(comm)
            model = make_model(config, recorder, quantize=quantize)
            recorder.attach(model)
            with torch.inference_mode():
                model(prompt)
            schedules[name] = recorder.events
        return {"logits": logits, "schedules": schedules}
    finally:
        shutdown_distributed()
