"""The server's engine without HTTP: continuous batching and chunked prefill give every request the
tokens it gets alone (and those of `Engine.generate`), rows move when requests leave, and the ladder
overlap holds in the server's decode step."""

import threading
import time

import torch

from ladder.comm.base import LocalCommunicator
from ladder.engine import Engine, SamplingParams
from ladder.serve.metrics import ServerMetrics
from ladder.serve.scheduler import GenerationParams, Output, Scheduler
from ladder.serve.steps import PrefillChunk, StepPlan, StepRunner

from helpers import RecordingCommunicator, make_model, overlapped_modules, tiny


def run_requests(model, requests, max_batch=4, prefill_chunk=4, cancel_after=None):
    """Submit every (prompt, params) at once, run the scheduler until all finish; each one's outputs."""
    scheduler = Scheduler(StepRunner(model, max_batch, 96), None, ServerMetrics("tiny"), max_batch, 64, prefill_chunk)
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
    prompts = [[1, 2, 3], list(range(5, 25)), [7] * 11, [9, 8, 7, 6, 5, 4]]  # the long ones prefill in 4-token chunks
    lengths = [12, 5, 9, 7]
    together, scheduler = run_requests(model, [(p, greedy(n)) for p, n in zip(prompts, lengths)], max_batch=3)
    for prompt, n, outputs in zip(prompts, lengths, together):
        alone, _ = run_requests(model, [(prompt, greedy(n))])
        reference = Engine(model).generate(torch.tensor([prompt]), n).tokens[0]
        assert ids(outputs) == ids(alone[0]) == reference
        assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == n
    assert not scheduler.running and scheduler.prefilling is None  # every row given back


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
    runner = StepRunner(model, 4, 64)
    runner.run(StepPlan(prefill=PrefillChunk(0, [1, 2, 3], 0)))
    runner.run(StepPlan(prefill=PrefillChunk(1, [4, 5], 0)))
    recorder.events.clear()
    recorder._launched = 0
    runner.run(StepPlan(decode_tokens=[7, 8], decode_positions=[3, 2]))  # two requests at their own positions
    assert all(overlapped_modules(recorder.events))
