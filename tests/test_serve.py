"""`ladder serve` as a user meets it: a real server process, spoken to with the official `openai` client
(and raw HTTP where a client would refuse to send the request)."""

import json
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from ladder.bench.serve_load import LoadSpec, draw_requests, load_tokenizer, server_followers, wait_until_healthy
from ladder.checkpoint.hf import save_random_hf
from ladder.cli.main import build_parser
from ladder.cli.serve import serving_step
from ladder.comm.base import LocalCommunicator
from ladder.model.config import get_preset
from ladder.model.spec import ModelSpec
from ladder.model.weights import random_model
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine
from ladder.serve import worker

from helpers import Server, free_port, ladder_in_process, start_two_nodes

openai = pytest.importorskip("openai")

SMOLLM = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm():
    server = Server("--model", SMOLLM, "--max-batch", "4", "--max-model-len", "512", "--max-num-batched-tokens", "16")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def slow():
    """Random weights of a larger shape: a request takes long enough to act on it mid-way."""
    server = Server("--preset", "llama-160m", "--max-batch", "1", "--max-waiting", "1", "--max-model-len", "256")
    yield server
    server.stop()


def complete(server: Server, prompt="The capital of France is", **kwargs):
    return server.client.completions.create(model=server.model, prompt=prompt, **{"max_tokens": 12, "temperature": 0,
                                                                                   **kwargs})


# ---- answers ----------------------------------------------------------------------------------------------

def test_a_greedy_completion_is_what_ladder_generate_answers(smollm, capsys):
    answer = complete(smollm)
    generated = ladder_in_process(capsys, "generate", "--model", SMOLLM, "--prompt", "The capital of France is",
                                  "--max-new-tokens", "12")
    assert generated.returncode == 0, generated.stderr
    assert answer.choices[0].text == generated.stdout.removesuffix("\n")
    assert answer.usage.completion_tokens == 12 and answer.choices[0].finish_reason == "length"
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


def test_chat_streamed_and_not_gives_one_answer_with_usage(smollm):
    messages = [{"role": "user", "content": QUESTION}]
    whole = smollm.client.chat.completions.create(model=smollm.model, messages=messages, temperature=0, max_tokens=20)
    assert "Paris" in whole.choices[0].message.content and whole.usage.completion_tokens >= 1
    chunks = list(smollm.client.chat.completions.create(model=smollm.model, messages=messages, temperature=0,
                                                        max_tokens=20, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices


def test_concurrent_requests_keep_their_own_sampling_and_text(smollm):
    prompts = ["The capital of France is", "Once upon a time", "The three primary colors are", "def add(a, b):"]
    alone = [complete(smollm, p).choices[0].text for p in prompts]
    seeded = dict(temperature=0.9, top_p=0.9, seed=11, max_tokens=16)
    requests = [dict(prompt=p) for p in prompts] + [dict(prompt=prompts[1], **seeded), dict(prompt=prompts[2], temperature=1.0,
                                                                                             seed=3, extra_body={"top_k": 5})]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = [r.choices[0].text for r in pool.map(lambda kw: complete(smollm, **kw), requests)]
    assert together[:4] == alone  # greedy: the same tokens beside others as alone, no text crossing over
    assert together[4] == complete(smollm, prompts[1], **seeded).choices[0].text  # a seed repeats
    assert together[4] != alone[1]


def test_a_stop_string_across_a_token_boundary_is_never_emitted(smollm):
    chunks = [c.choices[0].text for c in complete(smollm, max_tokens=24, stream=True) if c.choices]
    k = next(i for i in range(len(chunks) - 1) if len(chunks[i].strip()) >= 2 and len(chunks[i + 1].strip()) >= 2)
    stop = chunks[k][-2:] + chunks[k + 1][:2]  # ends one token, begins the next
    full = "".join(chunks)
    expected = full[:full.index(stop)]
    stopped = complete(smollm, max_tokens=24, stop=[stop, "never appears"])
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    streamed = [c.choices[0].text for c in complete(smollm, max_tokens=24, stop=stop, stream=True) if c.choices]
    assert "".join(streamed) == expected


def test_echo_with_logprobs_gives_the_prompt_log_probabilities_the_model_computes(smollm):
    """What lm-eval's local-completions sends: the prompt as ids, echo, logprobs=1, max_tokens 0 or 1. The
    server prefills in chunks of 16 tokens (--max-num-batched-tokens); one forward over the whole prompt
    here, so a chunk border that lost a position or a target would show."""
    loaded = ModelSpec(model=SMOLLM, dtype="float32").load(LocalCommunicator(), torch.device("cpu"))
    ids = loaded.tokenizer.encode("The three primary colors are red, blue and yellow. The capital of France is")
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(torch.tensor([ids])).float()[0], dim=-1)  # (T, V)
    expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    for max_tokens in (0, 1):
        answer = smollm.client.completions.create(model=smollm.model, prompt=[ids], echo=True, logprobs=1,
                                                  max_tokens=max_tokens, temperature=0)
        logprobs = answer.choices[0].logprobs
        assert len(logprobs.tokens) == len(ids) + max_tokens and logprobs.token_logprobs[0] is None
        assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=2e-4)
        best = [logp[i - 1].max().item() for i in range(1, len(ids))]
        assert [max(top.values()) for top in logprobs.top_logprobs[1:len(ids)]] == pytest.approx(best, abs=2e-4)
        assert answer.choices[0].text.startswith(loaded.tokenizer.decode(ids))
        assert answer.usage.completion_tokens == max_tokens
    greedy = logprobs.token_logprobs[-1]  # the new token: the argmax after the prompt
    assert greedy == pytest.approx(logp[-1].max().item(), abs=2e-4) == max(logprobs.top_logprobs[-1].values())
    streamed = [c.choices[0] for c in complete(smollm, max_tokens=4, logprobs=2, stream=True) if c.choices]
    entries = [lp for c in streamed if c.logprobs for lp in c.logprobs.token_logprobs]
    assert len(entries) == 4 and all(len(c.logprobs.top_logprobs[0]) == 2 for c in streamed if c.logprobs)
    whole = complete(smollm, max_tokens=4, logprobs=2)
    assert whole.choices[0].logprobs.token_logprobs == pytest.approx(entries, abs=1e-6)


# ---- refusals -------------------------------------------------------------------------------------------

def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(smollm):
    raw = httpx.post(smollm.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        smollm.client.completions.create(model="gpt-4", prompt="hi")
    bad = [dict(temperature="hot"), dict(temperature=5), dict(max_tokens=0), dict(n=2), dict(logprobs=21),
           dict(echo=True, stream=True), dict(echo=True, logprobs=-1),
           dict(max_tokens=600), dict(prompt="word " * 600), dict(prompt=[1, 2, 10**6]), dict(prompt=["a", "b"])]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            complete(smollm, **kwargs)
        assert caught.value.body["message"], kwargs
    with pytest.raises(openai.BadRequestError, match="not on chat completions"):
        smollm.client.chat.completions.create(model=smollm.model, messages=[{"role": "user", "content": "hi"}],
                                              logprobs=True)
    with pytest.raises(openai.BadRequestError, match="text content parts"):
        smollm.client.chat.completions.create(model=smollm.model, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    for route, body in (("completions", '"prompt": "a \\ud800 b"'),
                        ("chat/completions", '"messages": [{"role": "user", "content": "\\udfff"}]')):
        raw = httpx.post(f"{smollm.url}/v1/{route}", headers={"content-type": "application/json"},
                         content=f'{{"model": "{smollm.model}", {body}, "max_tokens": 2}}'.encode())
        assert raw.status_code == 400 and "not valid Unicode" in raw.json()["error"]["message"], raw.text
    assert complete(smollm).choices[0].text  # still serving
    assert httpx.get(smollm.url + "/health").status_code == 200


def test_an_api_key_guards_v1_in_openais_error_format_and_is_never_shown():
    key = "sk-" + uuid.uuid4().hex
    server = Server("--preset", "tiny", "--max-model-len", "64", env={"LADDER_API_KEY": key}, api_key=key)
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            refused = httpx.post(server.url + "/v1/completions", headers=headers, json={"prompt": [1], "max_tokens": 2})
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        answer = server.client.completions.create(model=server.model, prompt=[1, 2], max_tokens=3)
        assert answer.usage.completion_tokens == 3
        assert key not in httpx.get(server.url + "/metrics").text
    finally:
        assert server.stop() == 0
    logs = server.proc.stdout.read() + server.proc.stderr.read()
    assert logs and key not in logs


def test_metrics_count_requests_tokens_and_latencies(smollm):
    complete(smollm)
    text = httpx.get(smollm.url + "/metrics").text
    for name in ("ladder_time_to_first_token_seconds_count", "ladder_inter_token_latency_seconds_count",
                 "ladder_e2e_request_latency_seconds_count", "ladder_prompt_tokens_total",
                 "ladder_generation_tokens_total"):
        assert smollm.metric(name) > 0, name
    assert "ladder_num_requests_running" in text and "ladder_num_requests_waiting" in text


def test_a_client_that_disconnects_mid_stream_frees_its_row(smollm):
    aborted = smollm.metric("ladder_request_success_total", finished_reason="abort")
    with httpx.stream("POST", smollm.url + "/v1/completions", json={
            "model": smollm.model, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(4)]
    deadline = time.monotonic() + 20
    while smollm.metric("ladder_request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.1)
    assert smollm.metric("ladder_num_requests_running") == 0


def test_a_full_queue_answers_503_with_retry_after(slow):
    first = slow.client.completions.create(model=slow.model, prompt=[1, 2, 3], max_tokens=200, stream=True)
    next(iter(first))  # running: the one row is taken
    waiting = threading.Thread(target=lambda: slow.client.completions.create(model=slow.model, prompt=[4], max_tokens=5))
    waiting.start()
    time.sleep(0.5)  # queued: the one waiting place is taken
    refused = httpx.post(slow.url + "/v1/completions", json={"model": slow.model, "prompt": [5], "max_tokens": 5})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "server_overloaded"
    first.close()
    waiting.join(60)


# ---- the load benchmark ---------------------------------------------------------------------------------

def bench_serve(capsys, tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "load.jsonl"
    result = ladder_in_process(capsys, "bench", "serve", *args, "--out", str(out))  # its server, if any, a process
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def assert_ordered(stats: dict) -> None:
    assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], stats


def test_bench_serve_drives_a_running_server_with_shakespeare_prompts(smollm, tmp_path, capsys):
    spec = LoadSpec(num_requests=4, output_len=8, prompt_len=32)
    [record] = bench_serve(capsys, tmp_path, "--url", smollm.url, "--num-requests", "4", "--output-len", "8",
                           "--prompt-len", "32")
    drawn = draw_requests(spec, load_tokenizer(spec))
    assert record["completed"] == 4 and record["failed"] == 0 and record["usage_from"] == "server"
    assert record["total_output_tokens"] == sum(r.output_len for r in drawn)  # ignore_eos: every drawn length
    assert record["total_prompt_tokens"] == sum(r.prompt_tokens for r in drawn)  # the server counts what we did
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert_ordered(record[name])
    assert record["ttft_ms"]["n"] == 4 and record["e2e_ms"]["p50"] >= record["ttft_ms"]["p50"]


def test_bench_serve_starts_its_own_server_and_plots_latency_against_load(tmp_path, capsys):
    records = bench_serve(capsys, tmp_path, "--serve", "--preset tiny --max-batch 2 --eager", "--dataset", "fixed",
                          "--byte-prompts", "--prompt-len", "8", "--output-len", "5", "--num-requests", "5",
                          "--request-rates", "20,inf", "--plot", str(tmp_path / "load.png"))
    assert [r["request_rate"] for r in records] == [20.0, float("inf")]
    for record in records:
        assert record["completed"] == 5 and record["total_output_tokens"] == 25 and record["total_prompt_tokens"] == 40
        assert record["itl_ms"]["n"] == 5 * 4  # a chunk per token after the first (a random model's ids as text)
        assert_ordered(record["itl_ms"])
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- processes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--cuda-graph"], "--cuda-graph needs a CUDA device (use --compile or --compile-layers on the CPU)"),
    (["--compile", "--compile-layers"], "--compile compiles the whole decode step and --compile-layers each layer"),
    (["--eager", "--compile-layers"], "--eager goes with none of --compile, --compile-layers and --cuda-graph"),
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--max-model-len", "4096"], "--max-model-len 4096 exceeds the model's max_seq_len 128"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory 'lots': give a fraction of the free memory (0.2) or a size"),
])
def test_bad_server_options_are_one_line_and_nonzero(args, message, capsys):
    if args == ["--cuda-graph"] and torch.cuda.is_available():
        pytest.skip("the machine has CUDA")
    out = ladder_in_process(capsys, "serve", "--preset", "tiny", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize("flags, device, step", [
    ([], "cpu", DecodeStep.COMPILED_LAYERS), (["--eager"], "cpu", DecodeStep.EAGER),
    (["--interconnect", "pcie-no-p2p"], "cpu", DecodeStep.EAGER),  # an emulated link's step: not cached
    (["--compile"], "cpu", DecodeStep.COMPILED), ([], "cuda", DecodeStep.EAGER),
    (["--compile-layers", "--cuda-graph"], "cuda", DecodeStep.COMPILED_LAYERS_CUDA_GRAPH),
])
def test_a_cpu_server_compiles_its_layers_unless_asked_otherwise(flags, device, step):
    args = build_parser("serve").parse_args(["serve", "--preset", "tiny", *flags])
    assert serving_step(args, torch.device(device)) is step


def test_a_131072_position_model_serves_from_a_kv_budget_and_metrics_show_it(tmp_path):
    """Llama-3.1's context in the config: the cache holds what the budget holds, not rows x 131072."""
    config = get_preset("tiny", max_seq_len=131072)
    folder = save_random_hf(tmp_path / "long", config, None)
    server = Server("--model", str(folder), "--kv-cache-memory", "4MiB", "--max-batch", "4")
    per_position = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 4
    context = 4 * 2**20 // 4 // per_position // 64 * 64
    assert server.client.models.list().data[0].max_model_len == context < 131072
    answer = server.client.completions.create(model=server.model, prompt=[1, 2, 3], max_tokens=5, temperature=0)
    assert answer.usage.completion_tokens == 5
    assert server.metric("ladder_kv_cache_bytes") == 4 * context * per_position <= 4 * 2**20
    assert "ladder_kv_cache_usage_perc" in httpx.get(server.url + "/metrics").text
    assert server.stop() == 0
    assert f"KV cache 4.0 MiB of a 4.0 MiB budget: 4 rows of {context} positions" in server.proc.stderr.read()


def test_a_context_the_kv_budget_cannot_hold_is_refused_in_one_line_before_the_weights_load(capsys):
    out = ladder_in_process(capsys, "serve", "--preset", "llama-160m", "--max-model-len", "2048",
                            "--kv-cache-memory", "1MiB")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "ladder: error: the KV cache budget of 1.0 MiB (--kv-cache-memory) holds 14 positions at 73728 bytes each; one "
        "sequence of 2048 positions needs 144.0 MiB: raise --kv-cache-memory or lower --max-model-len")
    assert "loaded in" not in out.stderr


@pytest.mark.parametrize("decode_step", [[], ["--compile-layers", "--max-model-len", "64"]], ids=["eager", "compiled"])
def test_tp2_on_gloo_answers_what_tp1_answers(decode_step):
    """Two gloo ranks, rank 0 sending each step's plan: the greedy tokens of the model at TP 1 (the tiny
    preset's random weights are one model at every TP degree), for requests running side by side; also
    with the decode step compiled at padded shapes (both ranks warm every shape up together)."""
    model = random_model(get_preset("tiny"), LocalCommunicator(), torch.device("cpu")).eval()
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42]]
    expected = [" ".join(map(str, Engine(model).generate(torch.tensor([p]), 20).tokens[0])) for p in prompts]
    server = Server("--preset", "tiny", "--tp", "2", "--max-batch", "2", "--max-num-batched-tokens", "4", *decode_step)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: complete(server, prompt=p, max_tokens=20).choices[0].text, prompts))
        assert [a.strip() for a in answers] == expected
    finally:
        assert server.stop() == 0


def test_sigterm_gives_streams_the_shutdown_timeout_then_ends_them_as_aborted_answers():
    """SIGTERM: the requests in flight get --shutdown-timeout seconds, then the scheduler aborts what is
    left: each stream ends with finish_reason "abort" (not cut off, no handler cancelled with a traceback),
    and the server exits 0. (On a loaded machine uvicorn once cancelled the handlers first, and the
    engine thread then failed on the closed event loop: exit 2.)"""
    server = Server("--preset", "llama-160m", "--max-batch", "2", "--max-model-len", "256", "--shutdown-timeout", "1")
    try:
        streams = [server.client.completions.create(model=server.model, prompt=[1, 2, 3], max_tokens=240, stream=True,
                                                    extra_body={"ignore_eos": True}) for _ in range(2)]
        firsts = [next(iter(stream)) for stream in streams]  # both running
        server.proc.send_signal(signal.SIGTERM)
        reasons = [[c.choices[0].finish_reason for c in [first, *stream]] for first, stream in zip(firsts, streams)]
        assert server.proc.wait(60) == 0
        assert [r[-1] for r in reasons] == ["abort", "abort"] and all(len(r) < 240 for r in reasons)
        assert "Traceback" not in server.proc.stderr.read()
    finally:
        server.proc.kill()


def test_a_dead_rank_ends_the_server_non_zero_without_hanging():
    server = Server("--preset", "tiny", "--tp", "2", env={"LADDER_DIST_TIMEOUT": "20"})
    try:
        followers = server_followers(server.proc.pid, server.port)
        assert len(followers) == 1, followers
        os.kill(followers[0], signal.SIGKILL)
        try:
            status = complete(server, prompt=[1, 2, 3]).choices and 200
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            status = getattr(exc, "status_code", "refused")
        assert status in (503, "refused")  # 503 from rank 0, or refused once the launcher has stopped it
        assert server.proc.wait(60) != 0
        assert "communication with the other ranks failed" in server.proc.stderr.read()
    finally:
        server.proc.kill()


def test_two_nodes_under_torchrun_serve_from_global_rank_0():
    """One torchrun agent per node (both on localhost here), one rank each: global rank 0 serves, the
    other follows its plans; SIGTERM to node 0's agent stops both ranks cleanly (torchrun's own agent
    reports the signal it got: that exit status is torch's)."""
    port = free_port()
    nodes = start_two_nodes([["serve", "--preset", "tiny", "--tp", "2", "--eager", "--port", str(port)]] * 2)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", nodes, 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        answer = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0)
        model = random_model(get_preset("tiny"), LocalCommunicator(), torch.device("cpu")).eval()
        assert answer.choices[0].text.split() == [str(t) for t in Engine(model).generate(torch.tensor([[1, 2, 3]]), 5).tokens[0]]
        nodes[0].send_signal(signal.SIGTERM)
        assert nodes[1].wait(60) == 0
        nodes[0].wait(60)
        assert "ladder: server stopped" in nodes[0].stderr.read()
    finally:
        for n in nodes:
            n.kill()


@pytest.mark.parametrize("dtype, computes_in_bf16, hinted", [(torch.bfloat16, True, True), (torch.bfloat16, False, False),
                                                            (torch.float32, True, False)])
def test_the_serving_line_names_a_faster_step_only_where_one_was_measured_faster(monkeypatch, dtype, computes_in_bf16,
                                                                                 hinted):
    monkeypatch.setattr(worker, "cpu_computes_in_bf16", lambda: computes_in_bf16)
    model = random_model(get_preset("tiny"), LocalCommunicator(), torch.device("cpu")).to(dtype)
    assert ("--compile" in worker.faster_step_hint(Engine(model))) == hinted
    assert worker.faster_step_hint(Engine(model, DecodeStep.COMPILED_LAYERS)) == ""
