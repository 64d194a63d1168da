"""lm-evaluation-harness through ladder: `ladder eval --tasks` scores what lm-eval's own `hf` model scores on
the same folder (transformers running ladder's remote code), at TP 1 and 2, for loglikelihood, rolling
loglikelihood and generate-until; and lm-eval's `local-completions` scores the same through `ladder serve`
(prompt log-probabilities by echo)."""

import json
import logging

import pytest
import torch

from ladder.checkpoint.hf import save_random_hf
from ladder.checkpoint.resolve import open_checkpoint
from ladder.comm.base import LocalCommunicator
from ladder.model.config import get_preset
from ladder.model.spec import ModelSpec

from helpers import CPU, Server, ladder_cli, ladder_in_process

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from ladder.harness import ladder_lm, task_manager  # noqa: E402

MAX_LENGTH = 96  # shorter than a rolling document: several windows each
LIMITS = {"ladder_shakespeare_lastword": 6, "ladder_pydoc_rolling": 2, "ladder_arithmetic": 4}
# Each side sums float32 log-probabilities of a few hundred tokens, in batches of other shapes (right-padded
# here, and padded with a mask in transformers): ~1e-6 relative apart per token, measured 3e-7 on the sums.
RELATIVE = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A hybrid ladder model of random weights with SmolLM2's real tokenizer: transformers runs it with
    ladder's remote code, and every task's text tokenises as it would for SmolLM2."""
    tokenizer = open_checkpoint("smollm2-135m-instruct").tokenizer
    config = get_preset("tiny").replace(vocab_size=tokenizer.vocab_size, max_seq_len=256, layout="ladder",
                                        ladder_layers=2, tie_embeddings=True)
    return save_random_hf(tmp_path_factory.mktemp("hybrid") / "model", config, tokenizer, seed=3)


def evaluate(model, **kwargs) -> dict:
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    results = lm_eval.simple_evaluate(model=model, tasks=list(LIMITS), limit=None, task_manager=task_manager(
        list(LIMITS)), log_samples=False, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0, samples={t: list(range(n)) for t, n in LIMITS.items()}, **kwargs)
    return results["results"]


def assert_same_scores(ours: dict, theirs: dict) -> None:
    for task in LIMITS:
        metrics = {k: v for k, v in theirs[task].items() if "," in k and "stderr" not in k}
        assert metrics, task
        for name, value in metrics.items():
            assert ours[task][name] == pytest.approx(value, rel=RELATIVE), (task, name)


@pytest.fixture(scope="module")
def through_transformers(folder):
    return evaluate("hf", model_args={"pretrained": str(folder), "trust_remote_code": True, "dtype": "float32", "device": "cpu",
                                      "max_length": MAX_LENGTH}, batch_size=4)


def test_lm_eval_through_ladder_equals_lm_eval_through_transformers(folder, through_transformers):
    loaded = ModelSpec(model=str(folder), dtype="float32").load(LocalCommunicator(), CPU)
    ours = evaluate(ladder_lm(loaded.model, loaded.tokenizer, batch_size=3, max_length=MAX_LENGTH))
    assert_same_scores(ours, through_transformers)
    assert through_transformers["ladder_pydoc_rolling"]["word_perplexity,none"] > 1  # scored, not empty


def test_ladder_eval_tasks_at_tp_2_equals_transformers(folder, through_transformers, tmp_path):
    out = tmp_path / "scores.json"
    tasks = ",".join(LIMITS)
    done = ladder_cli("eval", "--model", str(folder), "--tasks", tasks, "--tp", "2", "--dtype", "float32",
                      "--max-length", str(MAX_LENGTH), "--batch-size", "2", "--limit", "6", "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ladder_shakespeare_lastword" in done.stdout and "|" in done.stdout  # lm-eval's table
    ours = json.loads(out.read_text())
    assert ours["tp"] == 2 and "hybrid" in ours["layout"]
    # --limit 6 takes the first six documents of each task: compare the tasks whose first LIMITS are six
    assert ours["results"]["ladder_shakespeare_lastword"]["acc,none"] == pytest.approx(
        through_transformers["ladder_shakespeare_lastword"]["acc,none"])
    assert ours["results"]["ladder_shakespeare_lastword"]["perplexity,none"] == pytest.approx(
        through_transformers["ladder_shakespeare_lastword"]["perplexity,none"], rel=RELATIVE)


@pytest.mark.parametrize("args,message", [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    (["--tasks", "ladder_arithmetic", "--text", "x.txt"], "one of them"),
    ([], "one of them"),
    (["--tasks", "ladder_arithmetic", "--reference", "smollm2-135m-instruct"], "go with --text"),
    (["--tasks", "ladder_arithmetic", "--include-path", "/no/such/folder"], "is not a folder"),
])
def test_eval_tasks_bad_input_is_one_line(args, message, capsys):
    said = ladder_in_process(capsys, "eval", "--preset", "tiny", *args)
    assert said.returncode != 0 and message in said.stderr
    assert len([line for line in said.stderr.splitlines() if line.strip()]) == 1, said.stderr


def test_local_completions_through_ladder_serve_scores_what_ladder_scores(folder):
    """lm-eval's OpenAI-compatible client scores loglikelihood tasks by echo and logprobs."""
    server = Server("--model", str(folder), "--max-batch", "2", "--max-model-len", "256", "--dtype", "float32")
    try:
        tasks = {"ladder_shakespeare_lastword": 6}
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        manager = task_manager(list(tasks))
        common = dict(tasks=list(tasks), task_manager=manager, log_samples=False,
                      samples={t: list(range(n)) for t, n in tasks.items()})
        served = lm_eval.simple_evaluate(model="local-completions", model_args={
            "base_url": f"{server.url}/v1/completions", "model": server.model, "tokenizer_backend": "huggingface",
            "tokenizer": str(folder), "max_length": 255, "num_concurrent": 1, "max_retries": 1}, **common)["results"]
        loaded = ModelSpec(model=str(folder), dtype="float32").load(LocalCommunicator(), CPU)
        ours = lm_eval.simple_evaluate(model=ladder_lm(loaded.model, loaded.tokenizer, max_length=255),
                                       **common)["results"]
    finally:
        assert server.stop() == 0
    task = "ladder_shakespeare_lastword"
    assert served[task]["acc,none"] == ours[task]["acc,none"]
    assert served[task]["perplexity,none"] == pytest.approx(ours[task]["perplexity,none"], rel=RELATIVE)
    assert torch.isfinite(torch.tensor(ours[task]["perplexity,none"]))
