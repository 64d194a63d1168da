"""Layout semantics at TP=1: the identities of docs/layouts.md, and KV-cached decode = full forward."""

import pytest
import torch

from helpers import (RecordingCommunicator, cached_logits, make_model, overlapped_modules,
                     reference_ladder_logits, tiny)
from ladder.comm.base import LocalCommunicator

# fp32 on CPU, identical weights: the only differences come from summation order (e.g. SDPA over a
# masked static cache vs. a causal forward), which stays within a few ulps of logits of size ~1.
ATOL = 1e-5

LAYOUTS = ["standard", "parallel", "ladder", "desync", "upper-bound"]
TOKENS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("n_ladder", [0, 1, 3, 4])
def test_ladder_equals_direct_recurrence(n_ladder):
    model = make_model(tiny(layout="ladder", ladder_layers=n_ladder))
    with torch.inference_mode():
        expected = reference_ladder_logits(model, TOKENS, n_ladder)
        got = model(TOKENS)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_full_ladder_differs_from_standard():
    # The recurrence must actually change the function (otherwise the identities above prove nothing).
    with torch.inference_mode():
        ladder = make_model(tiny(layout="ladder"))(TOKENS)
        standard = make_model(tiny())(TOKENS)
    assert (ladder - standard).abs().max() > 1e-3


def test_hybrid_extremes():
    with torch.inference_mode():
        standard = make_model(tiny())(TOKENS)
        ladder = make_model(tiny(layout="ladder"))(TOKENS)
        hybrid0 = make_model(tiny(layout="ladder", ladder_layers=0))(TOKENS)
        hybrid_all = make_model(tiny(layout="ladder", ladder_layers=4))(TOKENS)
    torch.testing.assert_close(hybrid0, standard, atol=ATOL, rtol=0)
    torch.testing.assert_close(hybrid_all, ladder, atol=ATOL, rtol=0)


@pytest.mark.parametrize("pattern", ["mlp", "attention", "none", "all"])
def test_desync_at_tp1_equals_standard(pattern):
    with torch.inference_mode():
        standard = make_model(tiny())(TOKENS)
        desync = make_model(tiny(layout="desync", desync_reduce=pattern))(TOKENS)
    torch.testing.assert_close(desync, standard, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS + ["hybrid"])
def test_kv_cached_decode_equals_full_forward(layout):
    config = tiny(layout="ladder", ladder_layers=2) if layout == "hybrid" else tiny(layout=layout)
    model = make_model(config)
    prompt, rest = TOKENS[:, :5], TOKENS[:, 5:]
    steps = cached_logits(model, prompt, rest)
    with torch.inference_mode():
        full = model(TOKENS)  # no cache: causal attention over the whole sequence
    torch.testing.assert_close(steps[0], full[:, :5], atol=ATOL, rtol=0)
    for i, step in enumerate(steps[1:]):
        torch.testing.assert_close(step[:, 0], full[:, 5 + i], atol=ATOL, rtol=0)


def test_llama31_rope_scaling_changes_long_range_only():
    from ladder.model.config import RopeScaling
    from ladder.model.attention import rope_inverse_frequencies
    base = tiny(rope_theta=500000.0)
    scaled = base.replace(rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64))
    plain, llama3 = rope_inverse_frequencies(base), rope_inverse_frequencies(scaled)
    assert torch.equal(plain[0], llama3[0])  # the highest frequency is untouched
    torch.testing.assert_close(llama3[-1], plain[-1] / 8)  # the lowest is divided by the factor


@pytest.mark.parametrize("layout,ladder_layers", [("standard", None), ("ladder", None), ("ladder", 2)])
def test_schedule_overlap_at_tp1(layout, ladder_layers):
    recorder = RecordingCommunicator(LocalCommunicator())
    model = make_model(tiny(layout=layout, ladder_layers=ladder_layers), recorder)
    recorder.attach(model)
    with torch.inference_mode():
        model(TOKENS)
    overlapped = overlapped_modules(recorder.events)
    n_ladder = model.config.n_ladder_layers
    first_ladder_module = 2 * (model.config.n_layers - n_ladder)
    # Overlapped: every module its successor reads stale, i.e. each one before a ladder module (in a
    # hybrid the last standard MLP too: the first ladder attention does not wait for its all-reduce).
    expected = [j + 1 >= first_ladder_module for j in range(len(overlapped))]
    assert overlapped == expected
