"""A real server under a thousand malformed or extreme requests (hypothesis): every one gets an answer
below 500, no traceback reaches the log, and a normal request is answered afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ladder.checkpoint.hf import save_random_hf
from ladder.checkpoint.resolve import open_checkpoint
from ladder.model.config import get_preset

from test_serve import Server

CONTEXT = 32  # every request that is valid generates a few tokens at most

ODD_TEXT = st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "\x00", "\u202e", "🙂" * 50, "<|im_end|>", "{{ x }}", ""])
TEXT = st.text(max_size=40) | ODD_TEXT
NUMBER = (st.integers(min_value=-10**40, max_value=10**40) | st.floats(allow_nan=False, allow_infinity=False)
          | st.sampled_from([0, -1, 2**63, 2**64, -2**63 - 1, 1e308, 5e-324]))
JSON = st.recursive(st.none() | st.booleans() | NUMBER | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=10)


def fields(vocab: int) -> dict:
    """Each field: a plausible value, an extreme one, or any JSON."""
    ids = st.lists(st.integers(min_value=-3, max_value=vocab + 3), max_size=6)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]) | JSON,
                                     "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                        "text": TEXT})) | JSON})
    return {
        "model": st.just("fuzz") | JSON,
        "prompt": ids | TEXT | st.lists(TEXT, max_size=2) | st.lists(ids, max_size=2) | JSON,
        "messages": st.lists(message, max_size=3) | JSON,
        "max_tokens": st.integers(min_value=-2, max_value=CONTEXT + 2) | NUMBER | JSON,
        "max_completion_tokens": st.integers(min_value=-2, max_value=CONTEXT + 2) | JSON,
        "temperature": st.floats(min_value=-1, max_value=3) | NUMBER | JSON,
        "top_p": st.floats(min_value=-0.5, max_value=1.5) | JSON,
        "top_k": NUMBER | JSON,
        "seed": NUMBER | JSON,
        "stop": TEXT | st.lists(TEXT, max_size=3) | JSON,
        "stop_token_ids": ids | JSON,
        "n": st.integers(min_value=-1, max_value=3) | JSON,
        "stream": st.booleans() | JSON,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
        "logprobs": st.booleans() | NUMBER | JSON,
        "ignore_eos": st.booleans() | JSON,
        "echo": st.booleans() | JSON,
        "presence_penalty": NUMBER | JSON,
    }


def one_field(strategies: dict) -> st.SearchStrategy:
    """A single field changed: the other fields valid, so the one that is not is the one looked at."""
    return st.sampled_from(sorted(strategies)).flatmap(lambda key: strategies[key].map(lambda value: {key: value}))


VALID = [{"model": "fuzz", "prompt": [1, 2, 3], "max_tokens": 4},
         {"model": "fuzz", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, {}]
RAW_BODIES = [b"", b"{", b"null", b"[]", b'"text"', b"\xff\xfe\xfd", b'{"model": "fuzz", "prompt": "\xc3\x28"}',
              b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b'{"model": 1e999999}',
              b'{"model": "fuzz", "prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}",
              b'{"model": "fuzz", "prompt": [1], "temperature": NaN}', b'{"model": "fuzz", "prompt": [1], "seed": Infinity}',
              b'{"model": "fuzz", "prompt": "\\ud800\\udc00\\udc00"}', b"\x00" * 1000]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny random model with SmolLM2's tokenizer and chat template: every path of the API, fast."""
    tokenizer = open_checkpoint("smollm2-135m-instruct").tokenizer
    config = get_preset("tiny", vocab_size=tokenizer.vocab_size, max_seq_len=CONTEXT)
    folder = save_random_hf(tmp_path_factory.mktemp("fuzz") / "fuzz", config, tokenizer)
    server = Server("--model", str(folder), "--served-model-name", "fuzz", "--max-batch", "4")
    yield server, config.vocab_size
    server.stop()


def post(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.slow
def test_a_thousand_malformed_requests_get_4xx_and_the_server_keeps_serving(server):
    server, vocab = server
    statuses = []
    client = httpx.Client(base_url=server.url, timeout=60)  # one connection, kept alive

    # No shrinking: a failure prints the example that failed, and minutes of shrinking would blow the
    # suite's time.
    @settings(max_examples=1000, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), base=st.sampled_from(VALID),
           fuzzed=one_field(fields(vocab)) | st.fixed_dictionaries({}, optional=fields(vocab)) | JSON)
    def one_request(path, base, fuzzed):
        body = {**base, **fuzzed} if isinstance(fuzzed, dict) else fuzzed  # a valid request with fields changed
        answer = post(client, path, json.dumps(body).encode())
        statuses.append(answer.status_code)
        assert answer.status_code < 500, (body, answer.text)

    one_request()
    for body in RAW_BODIES:
        for path in ("/v1/completions", "/v1/chat/completions"):
            answer = post(client, path, body)
            statuses.append(answer.status_code)
            assert answer.status_code < 500, (body[:80], answer.text)
    assert len(statuses) >= 1000 and any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
    answer = server.client.completions.create(model="fuzz", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4
    assert server.stop() == 0
    assert "Traceback" not in server.proc.stderr.read()
