"""Weight-only int8 and int4 (ladder.quant.quantize, through torchao) on one rank: every layout's logits stay
within the reasoned error of the unquantized model's, the right layers are quantized, the byte counts
that the benchmark, the memory estimate and the cost model use are the tensors' own, and every
combination torchao cannot run is refused in one line. TP=2 (real gloo ranks, the recorded overlap) is
in test_tp.py, a compiled quantized step at TP 2 in test_cli.py, SmolLM2 int4 at TP 2 in test_checkpoint.py."""

import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import INT4_RELATIVE_ERROR, INT8_RELATIVE_ERROR, cached_logits, make_model, relative_error, tiny
from ladder.checkpoint.hf import save_random_hf
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.cpu import linears as packing
from ladder.cpu.linears import Int8MatmulLinear, Int8RowLinear, weight_bytes
from ladder.errors import LadderError
from ladder.model.spec import ModelSpec
from ladder.model.transformer import Transformer
from ladder.options import CPU_GEMM_TEMPLATES, DECODE_ATTENTION, DecodeStep
from ladder.quant import quantize as quantize_module
from ladder.quant.quantize import block_linears, check_quantize, is_int8_per_row, is_quantized, quantize_shard
from ladder.runtime import engine as engine_module
from ladder.runtime.engine import Engine
from ladder.runtime.memory import block_linear_params, peak_cpu_bytes, weight_set_bytes

PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
DECODE = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(4))
QUANTIZABLE = dict(ffn_hidden=128)  # int4 groups of 32 input columns
LAYOUTS = {"standard": {}, "parallel": dict(layout="parallel"), "ladder": dict(layout="ladder"),
           "hybrid": dict(layout="ladder", ladder_layers=2), "desync": dict(layout="desync"),
           "upper-bound": dict(layout="upper-bound")}
BOUND = {"int8": INT8_RELATIVE_ERROR, "int4": INT4_RELATIVE_ERROR}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quantized_logits_stay_within_the_quantization_error(layout, mode, dtype):
    config = tiny(**LAYOUTS[layout], **QUANTIZABLE)
    expected = cached_logits(make_model(config).to(dtype), PROMPT, DECODE)
    quantized = make_model(config).to(dtype)
    quantize_shard(quantized, mode)
    errors = [relative_error(got, want) for got, want in zip(cached_logits(quantized, PROMPT, DECODE), expected)]
    assert max(errors) < BOUND[mode]
    assert min(errors) > 1e-4  # the weights were quantized: not the unquantized model again


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_block_linears_are_quantized_and_the_head_with_int8_only(mode):
    model = make_model(tiny(tie_embeddings=True, **QUANTIZABLE), quantize=mode)
    quantized = [name for name, module in model.named_modules() if is_quantized(module)]
    head = ["output"] if mode == "int8" else []
    assert quantized == [name for name, _ in block_linears(model)] + head
    assert len(quantized) == 4 * model.config.n_layers + len(head)
    assert type(model.tok_embeddings.weight) is torch.nn.Parameter  # the embedding only gathers rows
    assert (model.output.weight is model.tok_embeddings.weight) == (mode == "int4")  # int8: the head's own copy
    assert type(model.layers[0].attention_norm.weight) is torch.nn.Parameter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_the_memory_estimate_counts_the_quantized_tensors_bytes(mode, dtype):
    config = tiny(**QUANTIZABLE)
    model = make_model(config).to(dtype)
    quantize_shard(model, mode)
    # The estimate takes every row as dim wide (int8's scale per row); the MLP's down rows are wider.
    assert weight_set_bytes(config, 1, dtype.itemsize, mode) == pytest.approx(weight_bytes(model), rel=0.02)


def test_an_int8_head_quantized_in_row_chunks_is_torchaos_whole_table():
    ao = quantize_module._torchao()
    head = torch.nn.Linear(64, 1000, bias=False).to(torch.bfloat16)
    chunked = quantize_module.int8_in_row_chunks(ao, head.weight, rows=300)  # the last chunk short
    ao.quantize_(head, ao.Int8WeightOnlyConfig())
    assert torch.equal(chunked.qdata, head.weight.qdata) and torch.equal(chunked.scale, head.weight.scale)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(torch.nn.functional.linear(x, chunked), head(x))


def test_a_cpu_int4_weight_quantized_in_row_chunks_is_torchaos_whole_weight():
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

    ao = quantize_module._torchao()
    linear = torch.nn.Linear(64, 160, bias=False).to(torch.bfloat16)
    chunked = quantize_module.int4_in_row_chunks(ao, linear.weight, rows=128)  # the last chunk short
    ao.quantize_(linear, PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    assert torch.equal(chunked.qdata, linear.weight.qdata)
    assert torch.equal(chunked.scale_and_zero, linear.weight.scale_and_zero)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(torch.nn.functional.linear(x, chunked), linear(x))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_load_never_holds_the_unquantized_shard(tmp_path, mode):
    """Each block is quantized as soon as it is filled: loading peaks near the quantized model's bytes plus
    one unquantized block, where quantizing after the load would hold all eight blocks unquantized first."""
    config = tiny(n_layers=8, dim=128, ffn_hidden=384)
    folder = save_random_hf(tmp_path / "deep", config, TextTokenizer.bytes())
    spec = ModelSpec(model=str(folder), dtype="float32", quantize=mode)
    spec.config(), quantize_module._torchao()  # the header read and torchao imported, outside the measure
    peak, loaded = peak_cpu_bytes(lambda: spec.load(LocalCommunicator(), torch.device("cpu")))
    block = block_linear_params(config) // config.n_layers * 4  # one block's linears in float32
    assert weight_bytes(loaded.model) + 3 * block < 8 * block  # the bound below tells the two apart
    assert peak < weight_bytes(loaded.model) + 3 * block
    assert all(is_quantized(linear) for _, linear in block_linears(loaded.model))


class CalledOps(TorchDispatchMode):
    """Counts the aten operators that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def test_an_eager_cpu_bf16_int8_forward_runs_torchs_int8_kernel_and_casts_no_weight(monkeypatch):
    """torchao's eager int8 linear casts the whole weight to the activations' dtype each call; an eager CPU
    forward (an engine's eager view: `linear_forms`) calls the int8 kernel that a compiled step reaches, head
    included; a prefill dequantizes instead, in every step (a compiled step's prefill runs on the eager view).
    A compiled step's own view keeps torchao's layer, which inductor turns into that kernel. An fp32 model dequantizes
    blocks of rows (the kernel's fp32 path is not vectorized): torchao's logits, without its whole-weight copies."""
    fp32 = make_model(tiny(**QUANTIZABLE), quantize="int8")
    with torch.inference_mode():
        torchaos = fp32(PROMPT)
    fp32 = Engine(fp32).model
    monkeypatch.setattr(packing, "DEQUANTIZE_ROWS", 7)  # several blocks, the last one short
    with CalledOps() as ops, torch.inference_mode():
        torch.testing.assert_close(fp32(PROMPT), torchaos, atol=1e-5, rtol=1e-5)
    assert isinstance(fp32.output, Int8RowLinear) and ops.counts[torch.ops.aten._weight_int8pack_mm.default] == 0
    bf16 = make_model(tiny(**QUANTIZABLE), quantize="int8").to(torch.bfloat16)
    model = Engine(bf16).model
    with CalledOps() as ops, torch.inference_mode():
        model(PROMPT)
    assert ops.counts[torch.ops.aten._weight_int8pack_mm.default] == 4 * model.config.n_layers + 1
    assert ops.counts[torch.ops.aten.mm.default] == 0
    long_prompt = PROMPT.repeat(1, packing.INT8_DEQUANTIZE_MIN_ROWS)  # a prefill: dequantized, one GEMM
    with CalledOps() as ops, torch.inference_mode():
        dequantized = model(long_prompt)
    assert ops.counts[torch.ops.aten._weight_int8pack_mm.default] == 0
    with torch.inference_mode():
        monkeypatch.setattr(packing, "INT8_DEQUANTIZE_MIN_ROWS", 10**9)
        assert relative_error(dequantized, model(long_prompt)) < 0.01
    compiled = Engine(bf16, DecodeStep.COMPILED)
    assert isinstance(compiled.model.output, Int8RowLinear) and isinstance(compiled.model.layers[0].feed_forward.w2, Int8RowLinear)
    assert not isinstance(compiled._step_model.output, Int8RowLinear) and is_int8_per_row(compiled._step_model.output.weight)
    assert not isinstance(bf16.output, Int8RowLinear)  # the model given stays as it was


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_templated_steps_int8_layers_are_plain_tensors_that_give_torchaos_logits(monkeypatch, dtype):
    """A compiled step whose weights are constants of its graph (inductor's GEMM templates) cannot take
    torchao's tensor subclass as a constant: its int8 layers become plain int8 rows and scales on torch's
    int8 kernel (half precision), or plain weights dequantized once (float32). Run eagerly here: the logits
    are torchao's, within the rounding of sums taken in another order."""
    monkeypatch.setenv(CPU_GEMM_TEMPLATES, "1")
    model = make_model(tiny(**QUANTIZABLE), quantize="int8").to(dtype)
    with torch.inference_mode():
        torchaos = model(PROMPT)
        step_model = Engine(model, DecodeStep.COMPILED)._step_model
        got = step_model(PROMPT)
    wqkv = step_model.layers[0].attention.wqkv
    if dtype == torch.bfloat16:
        assert isinstance(wqkv, Int8MatmulLinear) and wqkv.qdata.dtype == torch.int8
    else:
        assert type(wqkv) is torch.nn.Linear and wqkv.weight.dtype == torch.float32
    assert not any(is_quantized(module) for module in step_model.modules() if isinstance(module, torch.nn.Linear))
    torch.testing.assert_close(got.float(), torchaos.float(), atol=3e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_an_eager_cpu_step_runs_int8_on_torchs_kernel_and_keeps_torchaos_int4(mode, monkeypatch):
    """bf16: int8 on torch's kernel gives torchao's logits, within bf16's rounding of sums taken in
    another order (a few bf16 ulps of logits near 1); int4 keeps torchao's kernel, the same logits. (As on
    a CPU with bf16 arithmetic: on AVX2 the engine would also run attention in float32; and attending through
    ATen's kernel, as the model does, not the eager step's default there: test_config checks that one.)"""
    monkeypatch.setattr(engine_module, "cpu_computes_in_bf16", lambda: True)
    monkeypatch.setenv(DECODE_ATTENTION, "sdpa")
    def bf16_model() -> Transformer:
        model = make_model(tiny(**QUANTIZABLE)).to(torch.bfloat16)
        quantize_shard(model, mode)
        return model

    model, expected = bf16_model(), cached_logits(bf16_model(), PROMPT, DECODE)
    engine = Engine(model, DecodeStep.EAGER)
    wqkv = engine.model.layers[0].attention.wqkv
    assert isinstance(wqkv, Int8RowLinear) if mode == "int8" else is_quantized(wqkv)
    for got, want in zip(cached_logits(engine.model, PROMPT, DECODE), expected):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2 if mode == "int8" else 0, rtol=0)


def test_refusals_are_one_line_errors(monkeypatch):
    with pytest.raises(LadderError, match="int4 on CUDA .* bfloat16"):
        check_quantize("int4", "cuda", torch.float32)
    with pytest.raises(LadderError, match="give one of int8, int4"):
        check_quantize("int3", "cpu", torch.float32)
    with pytest.raises(LadderError, match=r"groups 32 input columns, and layers.0.feed_forward.w2 has 80"):
        quantize_shard(make_model(tiny(ffn_hidden=80)), "int4")
    for name in [name for name in sys.modules if name.split(".")[0] == "torchao"] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    quantize_module._torchao.cache_clear()
    try:
        with pytest.raises(LadderError, match=r"needs torchao .*pip install \"ladder\[quantize\]\""):
            check_quantize("int8", "cpu", torch.float32)
    finally:
        quantize_module._torchao.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchao's CUDA kernels need a GPU")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_cuda_logits_stay_within_the_error_and_a_cuda_graph_decodes_the_eager_tokens(mode):
    def on_cuda(quantize: str | None):
        model = make_model(tiny(layout="ladder", ladder_layers=2, **QUANTIZABLE)).to("cuda", torch.bfloat16)
        quantize_shard(model, quantize)  # int4 on CUDA: tinygemm's tile-packed layout, bf16 only
        return model

    prompt = PROMPT.cuda()
    positions = torch.arange(prompt.shape[1], device="cuda")
    expected, quantized = on_cuda(None), on_cuda(mode)
    for model in (expected, quantized):
        model.setup_caches(*prompt.shape)
    with torch.inference_mode():
        error = relative_error(quantized(prompt, positions), expected(prompt, positions))
    assert 1e-4 < error < BOUND[mode]
    eager = Engine(quantized).generate(prompt, 6).tokens
    assert Engine(quantized, DecodeStep.CUDA_GRAPH).generate(prompt, 6).tokens == eager
