"""The generation engine: greedy = argmax, seeds, top-k / top-p sets, stop tokens, streaming, limits."""

import re

import pytest
import torch

from helpers import CPU, make_model, tiny
from ladder.comm.base import LocalCommunicator
from ladder.cpu.linears import HandleLinear
from ladder.errors import LadderError
from ladder.model.weights import random_model
from ladder.options import CPU_GEMM_TEMPLATES, DECODE_ATTENTION, INDUCTOR_OPTIONS, DecodeStep, RuntimeOptions
from ladder.quant.quantize import quantize_shard
from ladder.runtime.compile import INDUCTOR_CACHE_DIR, uses_gemm_templates, weights_digest
from ladder.runtime.engine import Engine, compiled_cache_length, decode_forward
from ladder.runtime.precompile import load_step
from ladder.runtime.sampling import SamplingBatch, SamplingParams, _keep_top_k, _keep_top_k_top_p, row_generators, sample
from ladder.runtime.step_clock import StepClock
from ladder.serve.worker import serving_options

PROMPT = torch.tensor([[5, 17, 42, 7], [9, 3, 200, 1]])


@pytest.fixture(scope="module")
def engine():
    return Engine(make_model(tiny(layout="ladder")))


def test_greedy_equals_argmax_of_full_forward(engine):
    result = engine.generate(PROMPT, 6)
    seq = PROMPT.clone()
    with torch.inference_mode():
        for _ in range(6):
            nxt = engine.model(seq)[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert result.tokens == seq[:, PROMPT.shape[1]:].tolist()


def test_last_only_logits_are_the_last_position_of_the_full_forward(engine):
    with torch.inference_mode():
        full, last = engine.model(PROMPT), engine.model(PROMPT, last_only=True)
    assert last.shape == (PROMPT.shape[0], 1, full.shape[-1])
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-6, atol=1e-6)


def test_temperature_zero_is_deterministic(engine):
    a = engine.generate(PROMPT, 8, SamplingParams(temperature=0, seed=1))
    b = engine.generate(PROMPT, 8, SamplingParams(temperature=0, seed=2))
    assert a.tokens == b.tokens


def test_same_seed_same_tokens_other_seed_other_tokens(engine):
    params = dict(temperature=1.5, top_k=100)
    a = engine.generate(PROMPT, 12, SamplingParams(seed=7, **params))
    b = engine.generate(PROMPT, 12, SamplingParams(seed=7, **params))
    c = engine.generate(PROMPT, 12, SamplingParams(seed=8, **params))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def sample_all(logits, params, seed=0):
    """Every row with the same parameters, row i seeded seed + i."""
    rows, vocab = logits.shape
    return sample(logits, SamplingBatch.of([params] * rows, row_generators(seed, rows, logits.device), vocab, logits.device))


def test_a_seeded_row_samples_the_same_alone_or_beside_other_rows():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(1.0, top_p=0.9), SamplingParams(), SamplingParams(0.7, top_k=20),
              SamplingParams(1.3), SamplingParams(2.0, top_k=50, top_p=0.5)]
    seeds = [11, 0, 5, 9, 2]
    together = sample(logits, SamplingBatch.of(params, [torch.Generator().manual_seed(s) for s in seeds], 300,
                                               logits.device))
    for row, (p, seed) in enumerate(zip(params, seeds)):
        alone = sample(logits[row:row + 1], SamplingBatch.of([p], [torch.Generator().manual_seed(seed)], 300,
                                                             logits.device))
        assert int(alone[0]) == int(together[row])
    assert int(together[1]) == int(logits[1].argmax())  # the greedy row takes its argmax beside sampled rows


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    tokens = sample_all(probs.log().repeat(6000, 1), SamplingParams(temperature=1.0))
    frequencies = torch.bincount(tokens, minlength=3) / 6000
    torch.testing.assert_close(frequencies, probs, atol=0.03, rtol=0)  # 6000 draws: 3 % is > 4 standard errors


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).repeat(500, 1)  # (2000, 50)
    allowed = torch.topk(logits, 5, dim=-1).indices
    tokens = sample_all(logits, SamplingParams(temperature=2.0, top_k=5))
    assert bool((allowed == tokens[:, None]).any(-1).all())
    assert len(set(tokens[:4 * 50].tolist())) > 5  # it does sample, not just take the argmax


def test_top_k_alone_masks_what_the_sort_that_serves_top_p_masks():
    """Top-k without top-p takes each row's k-th best from a top-k, not a sort: the same mask, ties included."""
    logits = torch.randint(-3, 4, (6, 40), generator=torch.Generator().manual_seed(2)).float()  # many ties
    for top_k in (torch.tensor([1, 3, 7, 40, 12, 5]), torch.tensor([1, 3, 7, 2, 12, 5])):
        expected = _keep_top_k_top_p(logits, top_k, None)
        torch.testing.assert_close(_keep_top_k(logits, top_k, int(top_k.max())), expected, rtol=0, atol=0)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log().repeat(2000, 1)
    tokens = sample_all(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75: the tail is cut, both heads appear
    tokens = sample_all(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_k_one_is_greedy():
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(1))
    tokens = sample_all(logits, SamplingParams(temperature=1.0, top_k=1))
    assert torch.equal(tokens, logits.argmax(-1))


def test_stop_token_and_max_tokens(engine):
    free = engine.generate(PROMPT[:1], 10)
    assert len(free.tokens[0]) == 10
    stop = free.tokens[0][3]
    stopped = engine.generate(PROMPT[:1], 10, stop_ids=[stop])
    first = free.tokens[0].index(stop)
    assert stopped.tokens[0] == free.tokens[0][: first + 1]


def test_streaming_callback_sees_every_token(engine):
    seen = []
    result = engine.generate(PROMPT, 5, on_token=lambda t: seen.append(t.tolist()))
    assert [list(col) for col in zip(*result.tokens)] == seen


def test_generations_in_turns_time_their_steps_as_laps_of_one_clock_with_no_gap(engine):
    """Each lap starts where the step before it, of either generation, ended: the laps cover the run, and
    each generation's own laps are its prefill and its decode steps."""
    other = Engine(make_model(tiny(layout="standard")))
    clock = StepClock(CPU)
    generations = [e.start(PROMPT, 4, clock=clock) for e in (engine, other)]
    for _ in range(4):
        for generation in generations:
            generation.step()
    laps = [lap for turn in zip(*(g.laps for g in generations)) for lap in turn]
    assert all(later.start == earlier.end for earlier, later in zip(laps, laps[1:]))
    for generation in generations:
        result = generation.result()
        assert result.prefill_s == generation.laps[0].seconds()
        assert result.token_latencies_s == [lap.seconds() for lap in generation.laps[1:]]
        assert result.decode_s == sum(result.token_latencies_s)


def test_prompt_longer_than_cache_is_an_error(engine):
    with pytest.raises(LadderError, match="exceeds the model's max_seq_len 128"):
        engine.generate(torch.zeros(1, 120, dtype=torch.long), 20)
    with pytest.raises(LadderError, match="exceeds the KV cache of 16 tokens"):
        engine.generate(PROMPT, 20, max_seq=16)


def test_out_of_vocabulary_prompt_is_an_error(engine):
    with pytest.raises(LadderError, match=r"\[0, 256\)"):
        engine.generate(torch.tensor([[1, 999]]), 2)


def test_compiled_decode_equals_eager_for_each_of_two_models_of_one_shape_and_a_restart_loads_its_step(
        monkeypatch, tmp_path):
    """With the weights as constants of the graph and inductor's C++ GEMM templates, a compiled CPU step's
    default (the other tests of compiled steps leave them out: conftest.py). The templates run (here
    the only GEMM allowed). A step is saved whole (`ladder.runtime.precompile`), under a name that digests
    every byte of the weights: the second model of the same shape must not run the first one's, and the
    first one, started again (a new process's dynamo) for a prompt of another length, loads its step and
    compiles nothing: the cache's length is rounded up as `ladder generate` rounds it
    (`compiled_cache_length`). A file whose traced functions read otherwise now (a new ladder, an edited
    model; here through the source digest torch checks) is not loaded. What AOT compile also wrote to AOTAutograd's cache is gone. int8 weights, as `--quantize int8`.
    The start that loads its step does not probe the CPU's vector ISA (inductor's build and new interpreter)."""
    from torch._dynamo import package
    from torch._dynamo.utils import counters
    from torch._inductor import cpu_vec_isa

    monkeypatch.setenv(CPU_GEMM_TEMPLATES, "1")
    monkeypatch.setenv(INDUCTOR_OPTIONS, '{"max_autotune_gemm_backends": "CPP"}')
    monkeypatch.setenv(INDUCTOR_CACHE_DIR, str(tmp_path / "inductor"))  # an empty cache
    probes = []
    for start, (seed, prompt) in enumerate(((0, PROMPT), (1, PROMPT), (0, PROMPT[:, :3]))):
        eager, compiled, max_seq = int8_engines(seed, prompt)
        if start == 2:  # a new process's inductor, which has not probed yet
            forget_vector_isa_probes()
            monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: probes.append(isa) or True)
        assert compiled.generate(prompt, 6, max_seq=max_seq).tokens == eager, f"seed {seed}"
        assert counters["aot_autograd"]["total"] == (0 if start == 2 else 1), (start, dict(counters["aot_autograd"]))
        assert start == 2 or counters["inductor"]["cpp_templated_kernel_counter"] > 0, dict(counters["inductor"])
        assert len(list((tmp_path / "inductor" / "ladder-steps").glob("*.aot"))) == min(start + 1, 2)
        assert not any((tmp_path / "inductor" / "aotautograd").glob("*"))
    forget_vector_isa_probes()  # (the stand-in's answers)
    assert not probes
    saved = compiled._forward.path_of(PROMPT.shape[0], max_seq)
    assert load_step(saved) is not None
    monkeypatch.setattr(package, "_hash_sourcelines", lambda *_: "another source")
    assert load_step(saved) is None  # so the step is compiled again (`SavedSteps._load_or_compile`)


def forget_vector_isa_probes() -> None:
    """inductor's answers of its vector ISA probe, kept for the process, forgotten."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()
    for isa in (cpu_vec_isa.VecAVX512, cpu_vec_isa.VecAVX512VNNI, cpu_vec_isa.VecAMX):
        isa.__bool__.cache_clear()


def int8_engines(seed: int, prompt: torch.Tensor) -> tuple[list[list[int]], Engine, int]:
    """A tiny int8 ladder model's eager tokens, and a compiled engine made as a new process makes it."""
    from torch._dynamo.utils import counters

    config = tiny(layout="ladder", n_layers=2, ladder_layers=1)
    model = random_model(config, LocalCommunicator(), CPU, torch.bfloat16, seed)
    quantize_shard(model, "int8")
    eager = Engine(model).generate(prompt, 6).tokens
    torch._dynamo.reset()  # what a new process starts with
    counters.clear()
    return eager, Engine(model, DecodeStep.COMPILED), compiled_cache_length(prompt.shape[1] + 6, config.max_seq_len)


def test_a_compiled_steps_cache_length_is_a_power_of_two_within_the_models_context():
    assert [compiled_cache_length(n, 8192) for n in (1, 64, 65, 104, 128, 129)] == [64, 64, 128, 128, 128, 256]
    assert compiled_cache_length(300, 200) == 200


@pytest.mark.parametrize("chosen, expected", [(None, True), (True, True), (False, False)])
def test_gemm_templates_are_a_compiled_cpu_steps_default(chosen, expected):
    assert uses_gemm_templates(RuntimeOptions(cpu_gemm_templates=chosen), CPU) is expected
    assert not uses_gemm_templates(RuntimeOptions(cpu_gemm_templates=True), torch.device("cuda"))


@pytest.mark.parametrize("chosen, expected", [(None, False), ("1", True), ("0", False)])
def test_a_server_packs_the_weights_into_gemm_templates_only_when_asked(monkeypatch, chosen, expected):
    """Each of a server's step shapes would pack a copy of the weights of its own (`serving_options`)."""
    monkeypatch.delenv(CPU_GEMM_TEMPLATES, raising=False)
    if chosen is not None:
        monkeypatch.setenv(CPU_GEMM_TEMPLATES, chosen)
    assert uses_gemm_templates(serving_options(DecodeStep.COMPILED), CPU) is expected
    assert uses_gemm_templates(RuntimeOptions.from_environment(DecodeStep.COMPILED), CPU) is (chosen != "0")


def test_the_weights_digest_reads_every_byte_and_not_the_kv_cache():
    model = make_model(tiny())
    model.setup_caches(2, 16)
    digest = weights_digest(model)
    model.layers[0].attention.kv_cache.k.fill_(1.0)
    assert weights_digest(model) == digest
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight[3, 5] += 1e-3
    assert weights_digest(model) != digest


@pytest.mark.parametrize("layout", ["ladder", "parallel"])
def test_compiled_layers_decode_equals_eager_and_every_layer_reuses_one_graph(monkeypatch, tmp_path, layout):
    """Regional compilation: one graph per branch, however many layers (6 here), one for the head, and
    the prefill eager (error_on_recompile: a layer that needed its own graph, or a prefill compiled then
    a decode step compiled for the same code, raises). (Saved in a folder of the test's own.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(INDUCTOR_CACHE_DIR, str(tmp_path / "inductor"))
    model = make_model(tiny(layout=layout, n_layers=6, ladder_layers=4 if layout == "ladder" else None))
    eager = Engine(model).generate(PROMPT, 6).tokens
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = Engine(model, DecodeStep.COMPILED_LAYERS)
        assert compiled.generate(PROMPT, 6).tokens == eager
        assert compiled.generate(PROMPT, 6).tokens == eager
    assert counters["stats"]["unique_graphs"] == (2 if layout == "parallel" else 3)  # attention, MLP; the head


@pytest.mark.parametrize("layout, ladder_layers", [("ladder", 3), ("parallel", None), ("desync", None)])
def test_a_warm_up_of_compiled_layers_runs_two_layers_and_makes_every_graph_the_whole_depth_needs(
        monkeypatch, tmp_path, layout, ladder_layers):
    """The warm-up runs each shape through the first two layers only (WARM_UP_LAYERS), and a decode step at
    every shape through all five then compiles nothing (error_on_recompile). Hybrid has standard and ladder
    layers; desync the unsynchronised streams (upper bound's too). Dynamo's eager backend: which
    graphs exist is dynamo's, and inductor would take a minute. (Saved in a folder of the test's own.)"""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(INDUCTOR_CACHE_DIR, str(tmp_path / "inductor"))
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **kw, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(make_model(tiny(layout=layout, n_layers=5, ladder_layers=ladder_layers)), DecodeStep.COMPILED_LAYERS)
    engine.reserve(2, 128, padded=True)
    last, calls = engine._step_model.layers[-1], []
    step_name = "parallel_step" if layout == "parallel" else "mlp_step"
    compiled_step = getattr(last, step_name)
    setattr(last, step_name, lambda *args: calls.append(args[0].shape) or compiled_step(*args))
    engine.warm_up()
    made = counters["stats"]["unique_graphs"]
    assert calls == [] and made > 0
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for batch, kv_len in engine.shapes:
            engine.decode(torch.arange(batch), [kv_len - 2] * batch)
    assert len(calls) == len(engine.shapes) and counters["stats"]["unique_graphs"] == made


@pytest.mark.parametrize("layout, regions", [("ladder", 2), ("parallel", 1), ("desync", 2)])
def test_a_compiled_forward_traces_one_layers_modules_and_stamps_out_the_others(layout, regions):
    """Each module runs as a compile region (`attention_region`): dynamo traces the first layer's and reuses
    that trace for the other five, and the engine's decode step (`decode_forward`) gives the eager logits."""
    from torch._dynamo.utils import compilation_time_metrics

    model = make_model(tiny(layout=layout, n_layers=6, ladder_layers=4 if layout == "ladder" else None))
    model.requires_grad_(False)
    model.setup_caches(2, 16)
    model(PROMPT, torch.arange(4))  # a prefill, then one decode step at position 4
    tokens, positions = PROMPT[:, -1:], torch.full((2, 1), 4)
    torch._dynamo.reset()
    for name in ("invoke_subgraph_trace", "invoke_subgraph_reuse_stamp_out"):
        compilation_time_metrics.pop(name, None)
    compiled = torch.compile(lambda: decode_forward(model, tokens, positions, 8), backend="eager", fullgraph=True)()
    traced, stamped = (len(compilation_time_metrics.get(name, ()))
                       for name in ("invoke_subgraph_trace", "invoke_subgraph_reuse_stamp_out"))
    assert (traced, stamped) == (regions, regions * 6 - regions)
    torch.testing.assert_close(compiled, decode_forward(model, tokens, positions, 8))


@pytest.mark.parametrize("kernel, traces", [("sdpa", set()), ("matmul", {"matmul_decode_attention"}),
                                            ("products", {"decode_attention"}), ("flex", {"flex_decode_attention"})])
def test_each_decode_attention_kernel_gives_eager_tokens(kernel, traces, monkeypatch):
    """LADDER_DECODE_ATTENTION picks a decode step's attention (a compiled step's on CPU: "products" by
    default); each attends to each row's own positions: the tokens of the eager step, which attends through
    ATen. The eager step attends alike when the option says so (flex compiles only)."""
    import ladder.model.attention as model_module

    model = make_model(tiny(layout="ladder", n_layers=2, ladder_layers=1))
    eager = Engine(model).generate(PROMPT, 6).tokens
    traced = set()
    for name in ("matmul_decode_attention", "decode_attention", "flex_decode_attention"):  # not ATen's
        def spy(*args, real=getattr(model_module, name), name=name):
            traced.add(name)
            return real(*args)
        monkeypatch.setattr(model_module, name, spy)
    monkeypatch.setenv(DECODE_ATTENTION, kernel)
    assert Engine(model, DecodeStep.COMPILED_LAYERS).generate(PROMPT, 6).tokens == eager
    assert traced == traces
    if kernel != "flex":
        traced.clear()
        assert Engine(model, RuntimeOptions(decode_attention=kernel)).generate(PROMPT, 6).tokens == eager
        assert traced == traces
    monkeypatch.setenv(DECODE_ATTENTION, "paged")
    with pytest.raises(LadderError, match="unknown decode attention 'paged': pick one of sdpa, matmul, products, flex"):
        Engine(model)
    monkeypatch.setenv(DECODE_ATTENTION, "flex")
    with pytest.raises(LadderError, match="flex compiles on a CPU with --compile-layers, not --compile"):
        Engine(make_model(tiny(layout="ladder")), DecodeStep.COMPILED)


def test_inductor_options_reach_every_compiled_step_and_bad_ones_are_refused(monkeypatch):
    """LADDER_INDUCTOR_OPTIONS adds inductor options to each compiled layer step and the head, and to a
    whole compiled step; bad ones are one-line errors."""
    model = make_model(tiny(layout="ladder", n_layers=2, ladder_layers=1))
    eager = Engine(model).generate(PROMPT, 4).tokens
    monkeypatch.setenv(INDUCTOR_OPTIONS, '{"coordinate_descent_tuning": true}')
    options = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: options.append(k.get("options")) or real_compile(*a, **k))
    assert Engine(model, DecodeStep.COMPILED_LAYERS).generate(PROMPT, 4).tokens == eager
    Engine(make_model(tiny(layout="ladder")), DecodeStep.COMPILED)
    from ladder.model.transformer import Block

    # each step's function, saved for every layer (the suite's cache is on), and the head; the whole step
    assert len(options) == len(Block.STEPS) + 1 + 1
    assert all(o["coordinate_descent_tuning"] is True for o in options)
    for text, message in [("{oops", "LADDER_INDUCTOR_OPTIONS is not JSON"),
                          ("[1]", "LADDER_INDUCTOR_OPTIONS must be a JSON object"),
                          ('{"no_such_option": 1}', "LADDER_INDUCTOR_OPTIONS: inductor has no option 'no_such_option'")]:
        monkeypatch.setenv(INDUCTOR_OPTIONS, text)
        with pytest.raises(LadderError, match=re.escape(message)):
            Engine(make_model(tiny(layout="ladder")), DecodeStep.COMPILED_LAYERS)


def test_a_compiled_cpu_step_reads_the_packed_weights_by_handle_and_its_saved_graph_serves_other_weights():
    """Without GEMM templates (a server's step), a compiled CPU step's linears read the eager view's packed
    weights (one copy) by handle, and its parameters, its own, do not require grad. Its graph holds no
    weight: a model that differs only in its linear weights loads the first one's saved step (nothing
    compiles) and decodes its own tokens. (The tests' cache: the next test's compiled step loads this one.)"""
    from torch._dynamo.utils import counters

    config = tiny(layout="ladder", n_layers=2, ladder_layers=1)
    first, second = (random_model(config, LocalCommunicator(), CPU, torch.float32, 0) for _ in range(2))
    with torch.no_grad():
        for layer in second.layers:
            layer.feed_forward.w2.weight.neg_()
    tokens = []
    for start, model in enumerate((first, second)):
        tokens.append(Engine(model).generate(PROMPT, 6).tokens)
        torch._dynamo.reset()  # what a new process starts with
        counters.clear()
        compiled = Engine(model, DecodeStep.COMPILED)
        assert compiled.generate(PROMPT, 6).tokens == tokens[-1]
    assert counters["aot_autograd"]["total"] == 0, dict(counters["aot_autograd"])
    assert tokens[0] != tokens[1]
    for eager_layer, step_layer in zip(compiled.model.layers, compiled._step_model.layers):
        for name in ("wqkv", "wo"):
            eager_linear, step_linear = getattr(eager_layer.attention, name), getattr(step_layer.attention, name)
            assert isinstance(step_linear, HandleLinear) and step_linear.packed is eager_linear.packed
    assert not any(p.requires_grad for p in compiled._step_model.parameters())
    assert all(p.requires_grad for p in second.parameters())


@pytest.mark.parametrize("step", [DecodeStep.EAGER, DecodeStep.COMPILED_LAYERS, DecodeStep.COMPILED])
def test_building_and_running_an_engine_leaves_the_model_it_was_given_as_it_was(step):
    """An engine decides on views of the model that share its weights: the caller's model keeps its layers,
    attention and methods (nothing compiled, packed or cached), and computes what it did."""
    from torch import nn

    model = make_model(tiny(layout="ladder", n_layers=2, ladder_layers=1))
    with torch.inference_mode():
        before = model(PROMPT)
    layers = [type(m) for m in model.modules()]
    tokens = Engine(model, step).generate(PROMPT, 4).tokens
    assert [type(m) for m in model.modules()] == layers
    assert all(type(layer.attention.wqkv) is nn.Linear and layer.attention.kv_cache is None
               and layer.attention.decode_kernel == "sdpa" and not set(vars(layer)) & {"attention_step", "mlp_step"}
               for layer in model.layers)
    assert model.max_seq == 0 and "head" not in vars(model)
    with torch.inference_mode():
        assert torch.equal(model(PROMPT), before)
    assert Engine(model).generate(PROMPT, 4).tokens == tokens
    model.setup_caches(2, 16)  # an engine's caches are its own, even where the model has some
    assert Engine(model).generate(PROMPT, 4).tokens == tokens
    assert model.layers[0].attention.kv_cache.k.abs().sum() == 0


def test_cuda_graph_decode_needs_cuda_and_excludes_compile():
    model = make_model(tiny(layout="ladder"))
    with pytest.raises(LadderError, match="CUDA graphs need a CUDA device; the model is on cpu"):
        Engine(model, DecodeStep.CUDA_GRAPH)
    with pytest.raises(LadderError, match="give one"):
        DecodeStep.from_flags(compile=True, cuda_graph=True)
    with pytest.raises(LadderError, match="--compile compiles the whole decode step and --compile-layers each layer"):
        DecodeStep.from_flags(compile=True, compile_layers=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_equals_eager():
    model = make_model(tiny(layout="ladder", ladder_layers=2)).cuda()
    prompt = PROMPT.cuda()
    eager = Engine(model).generate(prompt, 6).tokens
    graphed = Engine(model, DecodeStep.CUDA_GRAPH)
    assert graphed.generate(prompt, 6).tokens == eager
    assert graphed.generate(prompt, 6).tokens == eager  # replayed, not captured again
    compiled_layers = Engine(model, DecodeStep.COMPILED_LAYERS_CUDA_GRAPH)
    assert compiled_layers.generate(prompt, 6).tokens == eager
    assert compiled_layers.generate(prompt, 6).tokens == eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_decode_steps_queue_without_waiting_for_the_device():
    """A decode step never waits for the GPU (sync debug mode "error" raises at any call that would): the
    host queues the next step while this one runs. The prefill and the first decode steps (the capture)
    may wait."""
    model = make_model(tiny(layout="ladder", ladder_layers=2)).cuda()
    generation = Engine(model, DecodeStep.CUDA_GRAPH).start(PROMPT.cuda(), 8, SamplingParams(temperature=0.8, top_k=50))
    for _ in range(3):
        generation.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while not generation.finished:
            generation.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(generation.result().token_latencies_s) == 7
