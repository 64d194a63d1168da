"""The server's engine without HTTP: continuous batching and chunked prefill give every request the
tokens it gets alone (and those of `Engine.generate`), rows move when requests leave, and the ladder
overlap holds in the server's decode step."""

import json
import threading
import time

import pytest
import torch
from torch.profiler import profile

from ladder.comm.base import LocalCommunicator
from ladder.comm.emulated import EmulatedCommunicator
from ladder.comm.links import LinkModel
from ladder.errors import LadderError
from ladder.model.config import get_preset
from ladder.options import DecodeStep
from ladder.runtime.engine import Engine, PrefillChunk
from ladder.runtime.memory import KvCachePlan, parse_memory_setting, plan_kv_cache
from ladder.runtime.sampling import SamplingParams
from ladder.serve import scheduler as scheduler_module
from ladder.serve.metrics import ServerMetrics
from ladder.serve.scheduler import GenerationParams, Output, Scheduler
from ladder.serve.steps import StepPlan, run_plan

from ladder.model.weights import random_model

from helpers import RecordingCommunicator, in_flight_at_each_wait, make_model, overlapped_modules, tiny


def server_engine(model, max_batch, max_seq, step=DecodeStep.EAGER):
    """An engine as the server makes one: its cache and decode shapes reserved padded."""
    engine = Engine(model, step)
    engine.reserve(max_batch, max_seq, padded=True)
    return engine


def run_requests(model, requests, max_batch=4, token_budget=6, cancel_after=None, engine=None,
                 max_prefill_while_decoding=None):
    """Submit every (prompt, params) at once, run the scheduler until all finish; each one's outputs."""
    engine = engine or server_engine(model, max_batch, 96)
    scheduler = Scheduler(engine, None, ServerMetrics("tiny"), 64, token_budget,
                          max_prefill_while_decoding=max_prefill_while_decoding)
    outputs = [[] for _ in requests]
    done = threading.Semaphore(0)

    def emit(i):
        def on(out: Output):
            outputs[i].append(out)
            if out.finish_reason is not None:
                done.release()
        return on

    sequences = [scheduler.submit(p, params, emit(i)) for i, (p, params) in enumerate(requests)]
    engine = threading.Thread(target=scheduler.run)
    engine.start()
    if cancel_after is not None:
        index, n_outputs = cancel_after
        while len(outputs[index]) < n_outputs:
            time.sleep(0.001)
        scheduler.cancel(sequences[index])
    for _ in requests:
        assert done.acquire(timeout=60)
    scheduler.shutdown()
    engine.join(timeout=10)
    return outputs, scheduler


def ids(outputs: list[Output]) -> list[int]:
    return [int(t) for t in "".join(o.text for o in outputs).split()]  # a model without tokenizer: its ids


def greedy(max_tokens):
    return GenerationParams(max_tokens=max_tokens)


def test_every_request_gets_the_tokens_it_gets_alone_and_engine_generate_gives():
    model = make_model(tiny(layout="ladder", ladder_layers=2))
    prompts = [[1, 2, 3], list(range(5, 25)), [7] * 11, [9, 8, 7, 6, 5, 4]]  # in chunks of what the 4-token budget leaves
    lengths = [12, 5, 9, 7]
    together, scheduler = run_requests(model, [(p, greedy(n)) for p, n in zip(prompts, lengths)], max_batch=3,
                                       token_budget=4)
    for prompt, n, outputs in zip(prompts, lengths, together):
        alone, _ = run_requests(model, [(prompt, greedy(n))])
        reference = Engine(model).generate(torch.tensor([prompt]), n).tokens[0]
        assert ids(outputs) == ids(alone[0]) == reference
        assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == n
    assert not scheduler.running and scheduler.prefilling == []  # every row given back


def test_a_burst_prefills_together_within_the_token_budget_and_each_gets_its_tokens_alone(monkeypatch):
    model = make_model(tiny(layout="ladder", ladder_layers=2))
    prompts = [[1, 2, 3, 4, 5], [6, 7], list(range(8, 20)), [3, 1]]
    plans = []
    monkeypatch.setattr(scheduler_module, "run_plan", lambda engine, plan: plans.append(plan) or run_plan(engine, plan))
    together, _ = run_requests(model, [(p, greedy(6)) for p in prompts], token_budget=10)
    first = plans[0].prefill
    assert [(c.row, len(c.tokens), c.start) for c in first] == [(0, 5, 0), (1, 2, 0), (2, 3, 0)]  # 10 tokens
    assert all(len(p.decode_tokens) + sum(len(c.tokens) for c in p.prefill) <= 10 for p in plans)
    for prompt, outputs in zip(prompts, together):
        assert ids(outputs) == Engine(model).generate(torch.tensor([prompt]), 6).tokens[0]


def test_while_requests_decode_a_step_prefills_at_most_its_cap_and_the_whole_budget_when_none_do(monkeypatch):
    """--max-prefill-while-decoding: a step that decodes carries at most that many prompt tokens (each
    running stream waits for them); a step with nobody decoding fills the token budget. Tokens as alone."""
    model = make_model(tiny(layout="ladder", ladder_layers=2))
    prompts = [list(range(1, 13)), list(range(20, 27)), list(range(30, 50))]
    plans = []
    monkeypatch.setattr(scheduler_module, "run_plan", lambda engine, plan: plans.append(plan) or run_plan(engine, plan))
    outputs, _ = run_requests(model, [(prompts[0], greedy(8))], max_batch=3, token_budget=16,
                              max_prefill_while_decoding=3)
    assert [len(c.tokens) for c in plans[0].prefill] == [12]  # nobody decodes yet: the budget
    plans.clear()
    together, _ = run_requests(model, [(p, greedy(8)) for p in prompts], max_batch=3, token_budget=16,
                               max_prefill_while_decoding=3)
    assert [len(c.tokens) for c in plans[0].prefill] == [12, 4]  # nobody decodes yet: the budget
    decoding = [p for p in plans if p.decode_tokens]
    assert all(sum(len(c.tokens) for c in p.prefill) <= 3 for p in decoding)
    assert sum(len(c.tokens) for p in decoding for c in p.prefill) == 7 + 20 - 4
    for prompt, out in zip(prompts, together):
        assert ids(out) == Engine(model).generate(torch.tensor([prompt]), 8).tokens[0]


def test_seeded_sampling_repeats_and_a_cancelled_request_frees_its_row():
    model = make_model(tiny())
    sampled = GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=1.0, top_k=50), seed=7)
    first, _ = run_requests(model, [([1, 2, 3], sampled), ([4, 5], greedy(40))], max_batch=2, cancel_after=(1, 2))
    second, scheduler = run_requests(model, [([1, 2, 3], sampled)])
    assert ids(first[0]) == ids(second[0]) and len(ids(first[0])) == 20
    assert first[1][-1].finish_reason == "abort" and len(ids(first[1])) < 40
    assert scheduler.moves == [] and not scheduler.running


def test_a_stop_token_and_max_tokens_end_a_request():
    model = make_model(tiny())
    free = ids(run_requests(model, [([1, 2, 3], greedy(10))])[0][0])
    stop_at = free[4]
    outputs, _ = run_requests(model, [([1, 2, 3], GenerationParams(10, stop_token_ids=frozenset({stop_at})))])
    assert ids(outputs[0]) == free[:free.index(stop_at)] and outputs[0][-1].finish_reason == "stop"


def test_the_ladder_overlap_holds_in_the_servers_decode_step():
    recorder = RecordingCommunicator(LocalCommunicator())
    model = make_model(tiny(layout="ladder"), recorder)
    recorder.attach(model)
    engine = server_engine(model, 4, 64)
    run_plan(engine, StepPlan(prefill=[PrefillChunk(0, [1, 2, 3], 0)]))
    run_plan(engine, StepPlan(prefill=[PrefillChunk(1, [4, 5], 0)]))
    recorder.events.clear()
    recorder._launched = 0
    run_plan(engine, StepPlan(decode_tokens=[7, 8], decode_positions=[3, 2]))  # two requests at their own positions
    assert all(overlapped_modules(recorder.events))
    recorder.events.clear()
    recorder._launched = 0
    run_plan(engine, StepPlan(decode_tokens=[9, 6], decode_positions=[4, 3], prefill=[PrefillChunk(2, [1, 2, 3, 4], 0)]))
    assert all(overlapped_modules(recorder.events))  # and in its one forward of running rows and a prompt


@pytest.mark.parametrize("layout", ["standard", "parallel", "ladder", "desync"])
def test_one_forward_of_running_rows_and_prompt_chunks_equals_a_decode_then_a_prefill(layout):
    """The server's eager step (`Engine.decode_and_prefill`): the same logits as the two forwards, and the
    same cache, as the next decode step of all four rows shows."""
    model = make_model(tiny(layout=layout))
    chunks = [PrefillChunk(2, [9, 10, 11, 12, 13], 0), PrefillChunk(3, [14, 15], 0)]
    steps = []
    for mixed in (False, True):
        engine = server_engine(model, 4, 64)
        run_plan(engine, StepPlan(prefill=[PrefillChunk(0, [1, 2, 3], 0), PrefillChunk(1, [4, 5], 0)]))
        with torch.inference_mode():
            if mixed:
                decoded, prefilled = engine.decode_and_prefill([7, 8], [3, 2], chunks)
            else:
                decoded, prefilled = engine.decode([7, 8], [3, 2]), engine.prefill(chunks)
            after = engine.decode([6, 5, 4, 3], [4, 3, 5, 2])
        steps.append((decoded, prefilled, after))
    assert steps[1][0].shape == (2, model.config.vocab_size) and steps[1][1].shape == (2, model.config.vocab_size)
    for separate, together in zip(*steps):
        torch.testing.assert_close(together, separate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", [DecodeStep.EAGER, DecodeStep.COMPILED, DecodeStep.COMPILED_LAYERS])
def test_a_step_with_running_rows_and_a_prompt_chunk_runs_one_forward(monkeypatch, step):
    """On a CPU, the eager view's one forward where the decode step is compiled too (its decoding rows:
    test_compiled_layers_at_padded_shapes_give_every_request_its_eager_tokens)."""
    model = make_model(tiny())
    engine = server_engine(model, 2, 64, step)
    run_plan(engine, StepPlan(prefill=[PrefillChunk(0, [1, 2, 3], 0)]))
    forwards = []
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: forwards.append("forward"))
    monkeypatch.setattr(engine.model, "forward_mixed", lambda groups: forwards.append("mixed") or torch.zeros(2, 9))
    run_plan(engine, StepPlan(decode_tokens=[7], decode_positions=[3], prefill=[PrefillChunk(1, [4, 5], 0)]))
    assert forwards == ["mixed"]


def test_compiled_layers_at_padded_shapes_give_every_request_its_eager_tokens(monkeypatch, tmp_path):
    """Three requests decode padded to four rows while a fourth prefills in row 3: the padding row's
    writes (at the cache's last position) must not reach it. Every shape compiles in the warm-up, and none
    after it; the cache length is dynamic: the attention step compiles twice a batch size (below the whole
    cache, and the whole cache), not once a shape. (Saved in a folder of the test's own.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = make_model(tiny(layout="ladder", ladder_layers=2, max_seq_len=256))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], list(range(5, 25))]  # the last prefills in 5 chunks
    requests = [(p, greedy(n)) for p, n in zip(prompts, [12, 9, 10, 7])]
    eager, _ = run_requests(model, requests, engine=server_engine(model, 4, 256))
    torch._dynamo.reset()
    counters.clear()
    engine = server_engine(model, 4, 256, DecodeStep.COMPILED_LAYERS)
    assert engine.shapes == [(b, kv) for b in (1, 2, 4) for kv in (64, 128, 256)]
    engine.warm_up()
    assert counters["stats"]["unique_graphs"] == 6 + 3 + 3  # attention: two per batch; MLP and head: one per batch
    compiled, _ = run_requests(model, requests, engine=engine)
    assert [ids(o) for o in compiled] == [ids(o) for o in eager]
    assert counters["stats"]["unique_graphs"] == 6 + 3 + 3


@pytest.mark.parametrize("layout, in_flight", [("standard", [1] * 8), ("ladder", [2] * 7 + [1])])
def test_the_compiled_server_step_equals_eager_and_keeps_each_layouts_overlap(tmp_path, layout, in_flight):
    """The whole step compiled (one graph per shape, the emulated link traced into it): the warm-up
    writes nothing a request reads, the logits equal the eager step's, and in a profiler trace of a
    decode step each ladder all-reduce is still in flight while the next module computes."""
    cpu = torch.device("cpu")
    comm = EmulatedCommunicator(LinkModel("test", latency_us=200.0, bandwidth_gbps=1.0), world_size=2, device=cpu)
    model = random_model(get_preset("tiny", layout=layout), comm, cpu)
    eager = server_engine(model, 2, 64)
    run_plan(eager, StepPlan(prefill=[PrefillChunk(0, [1, 2, 3], 0)]))
    run_plan(eager, StepPlan(prefill=[PrefillChunk(1, [4, 5], 0)]))
    plan = StepPlan(decode_tokens=[7, 8], decode_positions=[3, 2])
    expected = run_plan(eager, plan).decoded

    compiled = server_engine(model, 2, 64, DecodeStep.COMPILED)  # a cache of its own: the same prefills
    run_plan(compiled, StepPlan(prefill=[PrefillChunk(0, [1, 2, 3], 0)]))
    run_plan(compiled, StepPlan(prefill=[PrefillChunk(1, [4, 5], 0)]))
    compiled.warm_up()
    logits = run_plan(compiled, plan).decoded
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)

    with profile() as trace:
        run_plan(compiled, StepPlan(decode_tokens=[9], decode_positions=[4]))  # one request, padded to no row
    trace.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert in_flight_at_each_wait(events, "ladder::emulated_all_reduce", ("ladder::emulated_wait",)) == in_flight


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphed_server_steps_give_every_request_its_eager_tokens():
    model = make_model(tiny(layout="ladder", ladder_layers=2)).cuda()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], list(range(5, 25))]
    requests = [(p, greedy(n)) for p, n in zip(prompts, [12, 9, 10, 7])]
    eager, _ = run_requests(model, requests, engine=server_engine(model, 4, 64))
    engine = server_engine(model, 4, 64, DecodeStep.CUDA_GRAPH)
    engine.warm_up()  # captures every shape
    assert [ids(o) for o in run_requests(model, requests, engine=engine)[0]] == [ids(o) for o in eager]
    assert [ids(o) for o in run_requests(model, requests, engine=engine)[0]] == [ids(o) for o in eager]  # replayed


def test_the_kv_cache_plan_fits_its_budget_and_refuses_what_cannot_fit():
    config = tiny()  # 4 layers x 2 KV heads x 16 x K and V x 4 bytes: 1024 bytes a position in fp32
    assert plan_kv_cache(config, 1, 4, 2**20, 8, None) == KvCachePlan(8, 128, 2**20, 2**20)  # the model's 128
    assert plan_kv_cache(config, 1, 4, 2**19, 8, None).max_model_len == 64  # what fits, in whole blocks
    assert plan_kv_cache(config, 1, 4, 300 * 1024, 8, 100) == KvCachePlan(3, 100, 300 * 1024, 300 * 1024)  # 3 rows
    assert plan_kv_cache(config, 2, 4, 300 * 1024, 8, 100).rows == 6  # a rank holds one KV head of two
    with pytest.raises(LadderError, match="holds 50 positions at 1024 bytes each; one sequence of 100 positions"):
        plan_kv_cache(config, 1, 4, 50 * 1024, 8, 100)


@pytest.mark.parametrize("text, value", [("0.2", 0.2), ("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1e9", 10**9)])
def test_kv_cache_memory_is_a_fraction_or_a_size(text, value):
    assert parse_memory_setting(text) == value


@pytest.mark.parametrize("text", ["lots", "0", "-1", "1.5", "4TB"])
def test_a_kv_cache_memory_that_is_neither_is_refused(text):
    with pytest.raises(LadderError, match="give a fraction of the free memory"):
        parse_memory_setting(text)


def test_a_handler_submits_while_the_engine_thread_detokenizes_and_finishes_are_typed():
    """Text, stop strings and outputs are made outside the lock that `submit` takes: an output callback
    that waits for a submit from another thread (as a handler's would) does not deadlock the server."""
    model = make_model(tiny(layout="ladder"))
    engine = server_engine(model, 2, 64)
    scheduler = Scheduler(engine, None, ServerMetrics("tiny"), 8, 8)
    submitted, finished = threading.Event(), threading.Semaphore(0)
    reasons = []

    def on_output(out: Output) -> None:
        if not submitted.is_set():  # the first output: a handler submits meanwhile
            handler = threading.Thread(target=lambda: scheduler.submit([4, 5], greedy(2), on_output) and submitted.set())
            handler.start()
            assert submitted.wait(timeout=10), "submit waited for the engine thread's output"
        if out.finish_reason is not None:
            reasons.append(out.finish_reason)
            finished.release()

    scheduler.submit([1, 2, 3], greedy(3), on_output)
    thread = threading.Thread(target=scheduler.run)
    thread.start()
    assert finished.acquire(timeout=30) and finished.acquire(timeout=30)
    scheduler.shutdown()
    thread.join(timeout=10)
    assert reasons == [scheduler_module.FinishReason.LENGTH] * 2 and reasons[0] == "length"
