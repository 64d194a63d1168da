"""Config: exact preset lookup, validation messages, persistence."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import make_model, tiny
from ladder.cpu import linears
from ladder.errors import LadderError
from ladder.model import attention as attention_module
from ladder.model import config
from ladder.model import transformer as model_module
from ladder.model.config import PRESETS, ModelConfig, get_preset
from ladder.model.spec import ModelSpec
from ladder.options import CPU_DTYPE, DecodeStep
from ladder.runtime import engine as engine_module
from ladder.runtime.engine import Engine


def test_paper_shapes():
    one_b = get_preset("1b")
    assert (one_b.dim, one_b.n_layers, one_b.n_heads, one_b.ffn_hidden, one_b.vocab_size) == (1536, 40, 24, 4096, 49152)
    seventy = get_preset("llama-3-70b")
    assert (seventy.dim, seventy.n_layers, seventy.n_heads, seventy.n_kv_heads, seventy.ffn_hidden) == (8192, 80, 64, 8, 28672)
    assert 69e9 < seventy.n_params() < 72e9
    assert 400e9 < get_preset("llama-3.1-405b").n_params() < 410e9
    assert 130e6 < get_preset("smollm2-135m").n_params() < 140e6
    assert get_preset("llama-3.1-8b").rope_scaling is not None


def test_lookup_is_exact():
    with pytest.raises(LadderError, match="unknown preset 'Tiny'"):
        get_preset("Tiny")
    assert all(get_preset(name) is PRESETS[name] for name in PRESETS)


def test_hybrid_is_ladder_with_ladder_layers():
    c = get_preset("smollm2-135m", layout="hybrid", ladder_layers=8)
    assert c.layout == "ladder" and c.n_ladder_layers == 8
    assert c.first_ladder_layer == 22  # layers 22..29
    assert get_preset("smollm2-135m", layout="ladder").first_ladder_layer == 0
    assert get_preset("smollm2-135m", layout="standard").first_ladder_layer == 30
    assert c.layout_name == "hybrid (ladder on last 8 of 30 layers)"


def test_ladder_layers_only_with_ladder_layout():
    with pytest.raises(LadderError, match="ladder_layers is set \\(2\\) but the layout is 'standard'"):
        get_preset("tiny").replace(ladder_layers=2)


def test_desync_reduce_pattern():
    c = get_preset("tiny", layout="desync")  # default: keep MLP reductions, drop attention ones
    assert [c.desync_reduces(j) for j in range(8)] == [False, True] * 4
    c = c.replace(desync_reduce="none")
    assert [c.desync_reduces(j) for j in range(8)] == [False] * 7 + [True]  # the last is always reduced


def test_round_trip_and_unknown_keys(tmp_path):
    c = get_preset("llama-3.1-8b", layout="ladder", ladder_layers=16)
    c.save(tmp_path / "config.json")
    assert ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text())) == c
    with pytest.raises(LadderError, match="unknown config keys: n_experts"):
        ModelConfig.from_dict({**c.to_dict(), "n_experts": 8})


@pytest.mark.parametrize("computes_in_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_the_cpu_default_dtype_is_bf16_only_where_the_cpu_computes_in_bf16(monkeypatch, computes_in_bf16, expected):
    monkeypatch.delenv(CPU_DTYPE)  # (the suite pins float32: tests/conftest.py)
    monkeypatch.setattr(config, "cpu_computes_in_bf16", lambda: computes_in_bf16)
    assert config.default_dtype("cpu") == expected
    assert config.default_dtype("cuda") == "bfloat16"
    assert ModelSpec(preset="tiny").dtype_name(torch.device("cpu")) == expected
    assert ModelSpec(preset="tiny", quantize="int8").dtype_name(torch.device("cpu")) == "bfloat16"
    monkeypatch.setenv(CPU_DTYPE, "bfloat16")
    assert config.default_dtype("cpu") == "bfloat16"
    monkeypatch.setenv(CPU_DTYPE, "fp8")
    with pytest.raises(LadderError, match="LADDER_CPU_DTYPE='fp8' is not one of float32, bfloat16, float16"):
        config.default_dtype("cpu")


def test_attention_computes_in_the_dtype_it_is_given():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 5, 16, generator=generator, dtype=torch.bfloat16) for n in (4, 2, 2))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    for m in (mask, None):
        upcast = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, is_causal=m is None,
                                                enable_gqa=True).to(torch.bfloat16)
        native = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None, enable_gqa=True)
        assert not torch.equal(upcast, native)  # the two differ, so the test tells them apart
        assert torch.equal(model_module.attend(q, k, v, m), native)
        assert torch.equal(model_module.attend(q, k, v, m, compute_dtype=torch.float32), upcast)


@pytest.mark.parametrize("compute_dtype, beyond", [(None, "sdpa"), (torch.float32, "products")])
def test_the_products_decode_attention_takes_long_caches_where_atens_would_upcast(monkeypatch, compute_dtype, beyond):
    """Up to DECODE_ATTENTION_MAX_POSITIONS the products attend; past it ATen's kernel, unless it would copy
    the whole cache to float32 first. Both give the same attention."""
    products_ran_at: list[int] = []  # the cached positions of each products attention
    products = attention_module.decode_attention
    monkeypatch.setattr(attention_module, "decode_attention",
                        lambda q, k, v, mask: products_ran_at.append(k.shape[2]) or products(q, k, v, mask))
    generator, limit = torch.Generator().manual_seed(0), attention_module.DECODE_ATTENTION_MAX_POSITIONS
    for positions in (limit, limit + 1):
        q, k, v = (torch.randn(2, n, t, 8, generator=generator, dtype=torch.bfloat16)
                   for n, t in ((4, 1), (2, positions), (2, positions)))
        mask = torch.rand(2, 1, 1, positions, generator=generator) < 0.5
        got = attention_module.attend(q, k, v, mask, "products", compute_dtype).float()
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, reference, atol=2e-2, rtol=2e-2)
    kernels = ["products" if positions in products_ran_at else "sdpa" for positions in (limit, limit + 1)]
    assert kernels == ["products", beyond]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_matmul_decode_attention_reads_each_rows_own_positions_of_a_strided_cache(dtype):
    """The eager half-precision kernel: grouped query heads over a slice of a larger cache (as a decode step
    reads it), each row masked to its own positions, gives ATen's attention."""
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 40, 8, generator=generator).to(dtype)  # (rows, KV heads, cache positions, hd)
    k, v = cache[:, :, :24], cache.flip(2)[:, :, :24]
    q = torch.randn(3, 6, 1, 8, generator=generator).to(dtype)
    mask = attention_module.cache_mask(torch.tensor([[0], [9], [23]]), 24)
    got = attention_module.attend(q, k, v, mask, "matmul")
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got.float(), reference, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    torch.testing.assert_close(got[0].float(), v[0, :, :1].float().repeat_interleave(3, 0), atol=1e-2, rtol=0)


@pytest.mark.parametrize("computes_in_bf16, amx", [(True, False), (True, True), (False, False)])
def test_an_engine_upcasts_half_precision_only_on_a_cpu_without_bf16_arithmetic(monkeypatch, computes_in_bf16, amx):
    """The engine decides it once, for its own view: attention and plain linear layers in float32 on such a
    CPU (`UpcastLinear`, where the layer is not packed), as they are elsewhere; the model it was given
    stays as it was. An eager bf16 step attends through ATen's kernel only where AMX makes it fast."""
    monkeypatch.setattr(engine_module, "cpu_computes_in_bf16", lambda: computes_in_bf16)
    monkeypatch.setattr(engine_module, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(linears, "packing_works", lambda dtype: False)
    model = make_model(tiny(layout="ladder")).to(torch.bfloat16)
    engine = Engine(model)
    attention = engine.model.layers[0].attention
    assert attention.compute_dtype == (None if computes_in_bf16 else torch.float32)
    assert attention.decode_kernel == ("matmul" if computes_in_bf16 and not amx else "sdpa")
    compiled = Engine(model, DecodeStep.COMPILED_LAYERS)  # its eager view decodes in a server's mixed steps
    assert compiled.model.layers[0].attention.decode_kernel == attention.decode_kernel
    assert isinstance(attention.wqkv, nn.Linear if computes_in_bf16 else linears.UpcastLinear)
    assert isinstance(model.layers[0].attention.wqkv, nn.Linear) and model.layers[0].attention.compute_dtype is None
    shared = attention.wqkv if computes_in_bf16 else attention.wqkv.layer
    assert shared.weight is model.layers[0].attention.wqkv.weight  # the weights shared, not copied


class MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matrix multiply that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_an_upcast_bf16_linear_multiplies_in_fp32_from_many_rows():
    layer = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    upcast = linears.UpcastLinear(layer)
    for rows, in_fp32 in ((1, False), (linears.UPCAST_MIN_ROWS, True)):
        x = torch.randn(1, rows, 16, dtype=torch.bfloat16)
        with MatmulDtypes() as seen:
            y = upcast(x)
        assert seen.dtypes == [torch.float32 if in_fp32 else torch.bfloat16], rows
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, layer(x))
