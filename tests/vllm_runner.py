"""Runs vLLM on ladder folders in a process of its own and prints what the tests compare, as JSON.

    python tests/vllm_runner.py '{"folders": [...], "tp": 1, "prompt_ids": [...], "max_tokens": 12,
                                  "eager": true, "folder_args": {}, "profile_dir": null}'
    ("prompt_ids" a list for every folder, or {folder: list} for each its own; "folder_args": {folder:
    {LLM keyword: value}} for one folder,
    e.g. its own tensor_parallel_size and pipeline_parallel_size; traces go to profile_dir/FOLDER_NAME/)

One engine per folder, one after another in this process: vLLM's start-up (its imports, its engine
and workers) is the cost of these tests, so a test module starts this once per TP degree. Prints
{"folder": {"ids": [...], "logprobs": [...], "traces": [...]}} (the log-probability of each chosen token); a folder vLLM refuses gives {"error": "<its message>"}.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch


# The KV cache's size, given: from a share of memory (gpu_memory_utilization, on CPU a share of the machine's),
# vLLM takes away the process's RSS first, so the share that fit one machine left no cache on a smaller one.
KV_CACHE_BYTES = 64 * 2**20
# An eager engine (enforce_eager) still compiles its sampler's log-probability ranking on the first request
# (`batched_count_greater_than`, about 20 s a process on two cores); with torch.compile off in each of its
# processes it ranks eagerly, the same ranks. (`import torch` has not read dynamo's settings yet.)
NO_COMPILE = "TORCH_COMPILE_DISABLE"


def inspect_model_classes_here() -> None:
    """vLLM inspects a lazily registered model class (its own Llama, the plugin's) in a fresh interpreter, so
    that this one does not initialise CUDA: 20-23 s each on two cores until its `modelinfos` cache holds the
    answer (empty in CI). A CPU has no CUDA to keep clean, and this process imports the class anyway."""
    from vllm.model_executor.models import registry

    assert callable(registry._run_in_subprocess), "vLLM's registry no longer inspects in a subprocess"
    registry._run_in_subprocess = lambda inspect: inspect()


def start_profile(worker) -> None:  # runs in each vLLM worker (collective_rpc)
    worker.ladder_profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    worker.ladder_profile.__enter__()


def stop_profile(worker, directory: str) -> str:
    worker.ladder_profile.__exit__(None, None, None)
    path = Path(directory) / f"rank{torch.distributed.get_rank()}.json"
    worker.ladder_profile.export_chrome_trace(str(path))
    return str(path)


def context_of(folder: str) -> int:
    return json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"]


def model_class(worker) -> str:
    return type(worker.model_runner.get_model()).__name__


def run(folder: str, settings: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        args = {"tensor_parallel_size": settings["tp"], **settings.get("llm_args", {}),
                **settings.get("folder_args", {}).get(folder, {})}
        llm = LLM(folder, enforce_eager=settings.get("eager", True),
                  dtype="float32", max_model_len=min(256, context_of(folder)), max_num_seqs=4, kv_cache_memory_bytes=KV_CACHE_BYTES,
                  skip_tokenizer_init=settings.get("skip_tokenizer_init", False), seed=0, **args)
    except Exception as exc:  # what a user of vLLM's Python API sees: the exception's message
        return {"error": f"{type(exc).__name__}: {exc}"}
    greedy = SamplingParams(temperature=0, max_tokens=settings["max_tokens"], ignore_eos=True, logprobs=0)
    prompt_ids = settings["prompt_ids"]
    prompt = TokensPrompt(prompt_token_ids=prompt_ids[folder] if isinstance(prompt_ids, dict) else prompt_ids)
    traces = None
    if settings.get("profile_dir"):
        llm.generate([prompt], greedy, use_tqdm=False)  # warm-up: the trace is of a steady step
        llm.collective_rpc(start_profile)
    (out,) = llm.generate([prompt], greedy, use_tqdm=False)
    if settings.get("profile_dir"):
        directory = Path(settings["profile_dir"]) / Path(folder).name
        directory.mkdir(parents=True, exist_ok=True)
        traces = llm.collective_rpc(stop_profile, args=(str(directory),))
    model = llm.collective_rpc(model_class)[0] if settings.get("report_model") else None
    del llm
    gc.collect()
    ids = list(out.outputs[0].token_ids)
    logprobs = [step[token].logprob for step, token in zip(out.outputs[0].logprobs, ids)]
    return {"ids": ids, "logprobs": logprobs, "traces": traces, "model": model}


def main() -> None:
    settings = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the functions above
    # the engine in this process (at TP 1 its worker too): one process fewer to start, each importing vLLM
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM waits 5 s for its workers to exit by themselves, which they do not here, then stops them
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    if settings.get("eager", True):
        os.environ.setdefault(NO_COMPILE, "1")
    if settings["tp"] > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one NUMA node: no rank-per-node binding
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # more ranks than cores: one thread each
    inspect_model_classes_here()
    results = {}
    for folder in settings["folders"]:
        results[folder] = run(folder, settings)
        from vllm.distributed import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
