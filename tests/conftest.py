"""Fixtures shared by several test files."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from ladder.options import CACHE_DIR, CPU_DTYPE, CPU_GEMM_TEMPLATES

# Tests compare ladder with transformers and with itself in float32, whatever this CPU computes in: every
# command the suite starts, in this process or another, defaults to it.
os.environ[CPU_DTYPE] = "float32"
# A compiled CPU step builds and times inductor's C++ GEMM templates for each shape (tens of seconds): the
# tests of compiled steps check tokens and overlap with inductor's defaults, and test_engine's with the templates.
os.environ[CPU_GEMM_TEMPLATES] = "0"
# GGUF files are converted once into a cache of the suite's own, never the user's (~/.cache/ladder)
os.environ[CACHE_DIR] = str(Path(tempfile.gettempdir()) / f"ladder-tests-cache-{os.getuid()}")
# Several test files at a time (scripts/test.sh) share the cores: each worker, and every process it starts,
# takes its share of threads. With more threads than cores, OpenMP's threads spin on cores that another
# process needs: two processes decoding the tiny preset on two cores took 26-28 ms a token with two
# threads each, 4.7-5.1 ms with one (alone, 5.1 ms).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # for the processes the tests start
    torch.set_num_threads(_threads)  # for this one, whose torch is already imported

# The files that take longest run first (scripts/test.sh runs files in this order, one file a worker):
# started last, test_vllm.py's ten minutes ran alone on one worker while the other stood idle.
LONGEST_FIRST = ("test_vllm.py", "test_bench.py", "test_cli.py", "test_serve.py", "test_train.py")


# Files whose tests start processes (servers, launchers, vLLM) nearly all: every test in them is `slow`.
# Elsewhere a test that starts processes or trains says so itself (@pytest.mark.slow). The rest,
# `pytest -m "not slow"`, is the quick tier for everyday work.
SLOW_FILES = (*LONGEST_FIRST, "test_soak.py", "test_harness.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a missing or misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    return model, single, sharded
