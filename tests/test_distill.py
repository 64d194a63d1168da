"""Distillation in `ladder train`: the KL of a model against itself is 0, the residual taps see the stream
the model computes, the loss falls, resume with a teacher is exact, LoRA adapters train and merge, the
teacher's answers are written once and read back, a calibrated conversion starts nearer its original, and a
teacher of other tokens is refused in one line."""

import copy
import dataclasses
import json

import pytest
import torch

from ladder.checkpoint.hf import save_random_hf
from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.comm.launch import launch
from ladder.errors import LadderError
from ladder.evaluate import compare, perplexity
from ladder.model.spec import ModelSpec
from ladder.runtime.completions import complete
from ladder.runtime.engine import Engine
from ladder.runtime.sampling import SamplingParams
from ladder.train.answers import ANSWERS_FILE, answer_texts
from ladder.train.calibrate import calibrate_stale_inputs
from ladder.train.distill import Objective, ResidualTaps, kl_to_teacher, residual_mismatch
from ladder.train.loop import freeze_non_ladder, train
from ladder.train.settings import TrainConfig, load_train_config

from helpers import CPU, ladder_in_process, make_model, python_docs_corpus, tiny

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return python_docs_corpus(tmp_path_factory.mktemp("corpus"), 60_000, 15_000)


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    """A tiny model pretrained a few steps: the original a ladder conversion starts from."""
    return str(train(config(corpus, tmp_path_factory.mktemp("teacher"), preset="tiny", model=None, steps=40,
                            lr=3e-3), progress=False).final_dir)


def config(corpus, out, **changes) -> TrainConfig:
    base = TrainConfig(preset=None, data=[str(corpus / "train.txt")], heldout=[str(corpus / "heldout.txt")], seq_len=32,
                       steps=6, batch_size=8, micro_batch_size=4, lr=1e-3, min_lr=1e-4, warmup_steps=2,
                       checkpoint_every=3, eval_every=3, eval_batches=2, out_dir=str(out), device="cpu")
    return dataclasses.replace(base, **changes)


def distill(corpus, out, teacher, **changes) -> TrainConfig:
    settings = dict(model=teacher, ladder_layers=2, trainable="converted", teacher="original", hidden_weight=1.0)
    return config(corpus, out, **{**settings, **changes})


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- the loss's parts ------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_the_kl_of_a_model_against_itself_is_zero(temperature):
    logits = torch.randn(2, 5, 256) * 4
    assert kl_to_teacher(logits, logits, temperature).item() == pytest.approx(0.0, abs=1e-6)
    assert kl_to_teacher(logits + 1.0, logits, temperature).item() == pytest.approx(0.0, abs=1e-5)  # shift-invariant
    assert kl_to_teacher(torch.randn(2, 5, 256), logits, temperature).item() > 0.1


def test_the_kl_is_the_mean_over_positions_of_the_definition():
    student, teacher = torch.randn(3, 7, 11), torch.randn(3, 7, 11)
    p, q = teacher.softmax(-1), student.softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    assert kl_to_teacher(student, teacher, 1.0).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("layout,n", [("standard", None), ("ladder", 2), ("ladder", None)])
def test_the_taps_add_up_to_the_stream_the_model_computes(layout, n):
    """The last tapped stream is what the final norm reads, whatever the layout (ladder adds its pending
    outputs late, but adds them all)."""
    model = make_model(tiny(layout=layout, ladder_layers=n))
    taps, seen = ResidualTaps(model), []
    model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad(), taps.recording():
        model(torch.randint(0, 256, (2, 9)))
    streams = taps.after_layers(0)
    assert streams.shape == (model.config.n_layers, 2, 9, model.config.dim)
    torch.testing.assert_close(streams[-1], seen[0], rtol=1e-5, atol=1e-5)
    assert residual_mismatch(streams, streams).item() == 0.0
    with torch.no_grad():  # nothing is recorded outside `recording`
        model(torch.randint(0, 256, (1, 3)))
    assert taps.after_layers(0).shape[2] == 9


@pytest.mark.parametrize("n", [1, 3])
def test_a_forward_from_the_shared_stream_equals_each_models_own(n):
    """Hybrid ladder on the last n of 4 layers and the standard model it came from go on from the stream
    the standard one computed before the first ladder layer, and give their own logits."""
    teacher, student = make_model(tiny()), make_model(tiny(layout="ladder", ladder_layers=n))  # one seed
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        shared = teacher.stream_before(tokens, student.config.first_ladder_layer)
        torch.testing.assert_close(student(tokens, resume_from=shared), student(tokens), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(teacher(tokens, resume_from=shared), teacher(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(student(tokens), teacher(tokens), atol=1e-3)  # the layouts do differ


def test_sharing_the_frozen_prefix_gives_the_same_losses_and_gradients():
    teacher = make_model(tiny())
    student = make_model(tiny(layout="ladder", ladder_layers=2)).train()
    freeze_non_ladder(student)
    tokens = torch.randint(0, 256, (2, 17))
    seen = []
    for share in (False, True):
        objective = Objective({"kl": 1.0, "hidden": 1.0, "ce": 0.5}, 2.0, student, teacher, share_prefix=share)
        terms = objective.losses(student, tokens[:, :-1], tokens[:, 1:])
        objective.total(terms).backward()
        seen.append(({k: v.item() for k, v in terms.items()},
                     {name: p.grad.clone() for name, p in student.named_parameters() if p.requires_grad}))
        student.zero_grad(set_to_none=True)
    (terms, grads), (shared_terms, shared_grads) = seen
    assert shared_terms == pytest.approx(terms, rel=1e-5) and terms["kl"] > 0 and terms["hidden"] > 0
    assert grads.keys() == shared_grads.keys() and all(k.startswith("layers.2.") or k.startswith("layers.3.")
                                                       for k in grads)
    for name in grads:
        torch.testing.assert_close(shared_grads[name], grads[name], rtol=1e-4, atol=1e-6)


def test_comparing_a_model_with_itself_agrees_everywhere_with_kl_zero():
    model = make_model(tiny())
    ids = torch.randint(0, 256, (300,)).tolist()
    result = compare(model, model, ids, window=64, progress=False)
    assert result["agreement"] == 1.0 and result["kl"] == pytest.approx(0.0, abs=1e-6)
    assert result["perplexity"] == pytest.approx(perplexity(model, ids, 64, progress=False)["perplexity"], rel=1e-6)
    other = compare(make_model(tiny(), seed=1), model, ids, window=64, progress=False)
    assert other["agreement"] < 0.5 and other["kl"] > 0.01
    assert other["reference_perplexity"] == pytest.approx(result["perplexity"], rel=1e-6)


# ---- training ------------------------------------------------------------------------------------------

def test_the_distillation_loss_falls_and_only_the_converted_layers_change(corpus, teacher, tmp_path):
    """Whole-ladder conversion of the tiny teacher: its held-out KL to the teacher falls by half or more
    in 12 steps (measured: 0.0106 -> 0.0026; without residual matching only to 0.0098), and only the
    blocks train."""
    original = ModelSpec(model=teacher, dtype="float32").load(LocalCommunicator(), CPU)
    converted = ModelSpec(model=teacher, ladder_layers=4, dtype="float32").load(LocalCommunicator(), CPU).model
    ids = original.tokenizer.encode((corpus / "heldout.txt").read_text())[:2000]
    before = compare(converted, original.model, ids, 64, progress=False)
    run = tmp_path / "run"
    result = train(distill(corpus, run, teacher, steps=12, ladder_layers=4), progress=False)
    rows = metrics(run)
    assert {"kl", "hidden"} <= set(rows[0]) and "ce" not in rows[0]
    assert sum(r["hidden"] for r in rows[-3:]) < sum(r["hidden"] for r in rows[:3])
    trained = ModelSpec(model=str(result.final_dir), dtype="float32").load(LocalCommunicator(), CPU).model
    after = compare(trained, original.model, ids, 64, progress=False)
    assert after["kl"] < 0.5 * before["kl"] and after["agreement"] > before["agreement"]
    from safetensors.torch import load_file
    weights, now = load_file(f"{teacher}/model.safetensors"), load_file(result.final_dir / "model.safetensors")
    assert all(torch.equal(weights[k], now[k]) for k in weights if not k.startswith("model.layers."))
    assert all(not torch.equal(weights[k], now[k]) for k in weights if k.startswith("model.layers.") and "proj" in k)
    state = json.loads((result.final_dir / "trainer_state.json").read_text())
    assert state["teacher"].startswith(teacher)


def test_a_ce_share_is_reported_beside_the_kl(corpus, teacher, tmp_path):
    run = tmp_path / "run"
    train(distill(corpus, run, teacher, steps=2, hidden_weight=0.0, ce_weight=0.5), progress=False)
    first = metrics(run)[0]
    assert first["loss"] == pytest.approx(first["kl"] + 0.5 * first["ce"], rel=1e-5)


@pytest.mark.parametrize("calibrate_tokens", [0, 2048])
def test_resume_with_a_teacher_is_exact_and_refuses_another_teacher(corpus, teacher, tmp_path, calibrate_tokens):
    run = dict(calibrate_tokens=calibrate_tokens)
    full = train(distill(corpus, tmp_path / "full", teacher, **run), progress=False)
    first = train(distill(corpus, tmp_path / "split", teacher, stop_at=3, **run), progress=False)
    second = train(distill(corpus, tmp_path / "split", teacher, **run), resume=True, progress=False)
    assert first.losses + second.losses == full.losses  # bit-exact
    assert [r["kl"] for r in metrics(tmp_path / "full")] == [r["kl"] for r in metrics(tmp_path / "split")]
    other = save_random_hf(tmp_path / "other", tiny(), TextTokenizer.bytes(), seed=5)
    changed = dataclasses.replace(distill(corpus, tmp_path / "split", teacher, steps=8), teacher=str(other))
    with pytest.raises(LadderError, match="another teacher"):
        train(changed, resume=True, progress=False)


@pytest.mark.parametrize("calibrate_tokens", [0, 2048])
def test_lora_trains_adapters_merges_them_into_the_checkpoint_and_resumes_exactly(corpus, teacher, tmp_path,
                                                                                  calibrate_tokens):
    """Calibrated first, an adapters' checkpoint holds no base weights: a resumed run calibrates again."""
    pytest.importorskip("peft")
    lora = dict(trainable="lora", lora_rank=4, lora_alpha=8.0, hidden_weight=0.0, calibrate_tokens=calibrate_tokens)
    full = train(distill(corpus, tmp_path / "full", teacher, **lora), progress=False)
    first = train(distill(corpus, tmp_path / "split", teacher, stop_at=3, **lora), progress=False)
    second = train(distill(corpus, tmp_path / "split", teacher, **lora), resume=True, progress=False)
    assert first.losses + second.losses == full.losses
    assert full.losses[-1] < full.losses[0] or calibrate_tokens  # (calibrated: a KL of 1e-7 left to learn)
    from safetensors.torch import load_file
    before, after = load_file(f"{teacher}/model.safetensors"), load_file(full.final_dir / "model.safetensors")
    adapted = [k for k in before if not torch.equal(before[k], after[k])]
    assert adapted and all(k.startswith(("model.layers.2.", "model.layers.3.")) for k in adapted)
    assert set(load_file(full.final_dir / "adapters.safetensors"))  # beside the merged weights
    # The merged checkpoint computes what the adapted model computed: its held-out loss, recomputed.
    loaded = ModelSpec(model=str(full.final_dir), dtype="float32").load(LocalCommunicator(), CPU)
    ids = loaded.tokenizer.encode((corpus / "heldout.txt").read_text())[:2 * 4 * 33]
    tokens = torch.tensor(ids).view(-1, 33)
    with torch.no_grad():
        logits = loaded.model(tokens[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert loss == pytest.approx(full.eval_loss, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_distillation_at_world_size_2_equals_world_size_1(corpus, teacher, tmp_path, parallel):
    one = train(distill(corpus, tmp_path / "one", teacher, steps=3), progress=False)
    two = launch(_train_losses, 2, distill(corpus, tmp_path / "two", teacher, steps=3, parallel=parallel))[0]
    assert two == pytest.approx(one.losses, rel=1e-4)  # the order of the gradient sums differs


def test_a_desync_student_distils_on_simulated_ranks_beside_an_int8_evaluation(corpus, teacher, tmp_path):
    """The paths `train` already has: desync's ranks simulated in one process, a quantized copy's held-out loss."""
    run = tmp_path / "run"
    train(distill(corpus, run, teacher, steps=3, layout="desync", ladder_layers=None, trainable="all",
                  hidden_weight=0.0, eval_quantize="int8"), progress=False)
    last = metrics(run)[-1]
    assert last["kl"] > 0 and "eval_loss_int8" in last and last["eval_loss"] > 0


def _train_losses(config: TrainConfig) -> list[float]:
    return train(config, progress=False).losses


# ---- calibration ------------------------------------------------------------------------------------------

def test_calibration_brings_a_conversion_closer_to_its_original_through_convert(corpus, teacher, tmp_path, capsys):
    """`ladder convert --calibrate`: the whole-ladder conversion of the tiny teacher, its inputs fitted on
    the training text, is nearer the teacher on held-out text (measured: KL 0.0287 -> 0.0003, greedy
    agreement 99.4 % -> 100 %); the layers before the converted ones, and every shape, are as they were.
    Without --calibrate, convert says that it exists."""
    plain, calibrated = tmp_path / "plain", tmp_path / "calibrated"
    common = ["convert", teacher, "--ladder-layers", "3"]
    said = ladder_in_process(capsys, *common, "--out", str(plain))
    assert said.returncode == 0 and "not calibrated: --calibrate TEXT" in said.stderr
    said = ladder_in_process(capsys, *common, "--out", str(calibrated), "--calibrate", str(corpus / "train.txt"),
                             "--calibrate-tokens", "4096")
    assert said.returncode == 0, said.stderr
    assert "calibrated 6 converted modules" in said.stderr and "on 4,096 tokens" in said.stderr
    original = ModelSpec(model=teacher, dtype="float32").load(LocalCommunicator(), CPU)
    ids = original.tokenizer.encode((corpus / "heldout.txt").read_text())[:2000]
    quality = {}
    for name in (plain, calibrated):
        model = ModelSpec(model=str(name), dtype="float32").load(LocalCommunicator(), CPU).model
        assert model.config.n_ladder_layers == 3
        quality[name] = compare(model, original.model, ids, 64, progress=False)
    assert quality[calibrated]["kl"] < 0.1 * quality[plain]["kl"]
    assert quality[calibrated]["agreement"] > quality[plain]["agreement"]
    from safetensors.torch import load_file
    before, after = load_file(plain / "model.safetensors"), load_file(calibrated / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {f"model.layers.{i}.{p}" for i in (1, 2, 3) for p in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight")}
    assert all(before[k].shape == after[k].shape for k in before)


def test_each_fit_sees_the_stream_of_the_modules_before_it_already_corrected():
    """A module's reported error is measured on the stream that the modules before it give once folded: the
    error of layer 3's attention input equals the one a model with only layer 2 calibrated gives it."""
    torch.manual_seed(0)
    original, student = make_model(tiny()), make_model(tiny(layout="ladder", ladder_layers=2))
    uncalibrated = copy.deepcopy(student)
    tokens = torch.randint(0, 256, (8, 32))
    fits = calibrate_stale_inputs(student, original, tokens)
    assert [(f.layer, f.module) for f in fits] == [(2, "attention"), (2, "mlp"), (3, "attention"), (3, "mlp")]
    assert all(f.error_after < f.error_before for f in fits)

    def layer_3_attention_input(model) -> torch.Tensor:
        inputs = []
        handle = model.layers[3].attention.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
        with torch.no_grad():
            model.stream_before(tokens, model.config.n_layers)
        handle.remove()
        return inputs[0]

    wanted = layer_3_attention_input(original)

    def attention_input_error(model) -> float:
        stale = layer_3_attention_input(model)
        return float((stale - wanted).square().sum() / wanted.square().sum())

    assert attention_input_error(uncalibrated) != pytest.approx(fits[2].error_before, rel=1e-3)
    uncalibrated.layers[2].load_state_dict(student.layers[2].state_dict())
    assert attention_input_error(uncalibrated) == pytest.approx(fits[2].error_before, rel=1e-4)


def test_distillation_from_a_calibrated_start_begins_nearer_the_teacher(corpus, teacher, tmp_path):
    """The first step's loss (KL + residual), measured 0.210 from the plain conversion, 0.101 calibrated."""
    plain = train(distill(corpus, tmp_path / "plain", teacher, steps=1, ladder_layers=4), progress=False)
    calibrated = train(distill(corpus, tmp_path / "calibrated", teacher, steps=1, ladder_layers=4,
                               calibrate_tokens=2048), progress=False)
    assert calibrated.losses[0] < 0.7 * plain.losses[0]
    record = json.loads((tmp_path / "calibrated" / "calibration.json").read_text())
    assert record["tokens"] == 2048 and len(record["modules"]) == 8


def test_calibration_is_refused_where_it_cannot_apply(corpus, teacher, tmp_path, capsys):
    original, standard = make_model(tiny()), make_model(tiny())
    with pytest.raises(LadderError, match="needs ladder_layers"):
        calibrate_stale_inputs(standard, original, torch.randint(0, 256, (8, 32)))
    with pytest.raises(LadderError, match="at least 256 tokens, not 64"):
        calibrate_stale_inputs(make_model(tiny(layout="ladder", ladder_layers=2)), original, torch.randint(0, 256, (2, 32)))
    said = ladder_in_process(capsys, "convert", teacher, "--out", str(tmp_path / "x"), "--calibrate", "pydoc")
    assert said.returncode != 0 and "give --ladder-layers N" in said.stderr and "Traceback" not in said.stderr


# ---- refusals, one line each -------------------------------------------------------------------------

def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(corpus, teacher, tmp_path):
    wider = save_random_hf(tmp_path / "wider", tiny(vocab_size=512), None)
    with pytest.raises(LadderError, match="vocabulary of 512 tokens and the student 256"):
        train(dataclasses.replace(distill(corpus, tmp_path / "run", teacher), teacher=str(wider)), progress=False)
    untokenized = save_random_hf(tmp_path / "untokenized", tiny(), None)
    with pytest.raises(LadderError, match="another tokenizer"):
        train(dataclasses.replace(distill(corpus, tmp_path / "run", teacher), teacher=str(untokenized)), progress=False)


@pytest.mark.parametrize("override,message", [
    ("trainable=some", "trainable must be one of all, converted, lora"),
    ("temperature=0", "temperature must be > 0"),
    ("hidden_weight=1", "need a teacher"),
    ("calibrate_tokens=4096", "need a teacher"),
    ("data_weights=1,2", "2 weights for 1 data sources"),
    ("lora_layers=first", "lora_layers must be converted or all"),
])
def test_distillation_settings_out_of_range_are_refused_before_training(override, message):
    with pytest.raises(LadderError, match=message):
        load_train_config(None, [override])


def test_hidden_matching_needs_a_ladder_conversion(corpus, teacher, tmp_path):
    with pytest.raises(LadderError, match="needs a ladder conversion"):
        train(distill(corpus, tmp_path / "run", teacher, ladder_layers=None, layout=None, trainable="all"),
              progress=False)


# ---- the teacher's answers ------------------------------------------------------------------------------

def test_ragged_prompts_complete_as_each_would_alone():
    engine = Engine(make_model(tiny()))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42]]
    together = complete(engine, prompts, 6, SamplingParams(), stop_ids=[], batch_size=3)
    alone = [complete(engine, [p], 6, SamplingParams(), stop_ids=[], batch_size=1)[0] for p in prompts]
    assert together == alone and all(len(t) == 6 for t in together)
    sampled = complete(engine, prompts, 6, SamplingParams(temperature=1.0, seed=3), stop_ids=[], batch_size=2)
    assert sampled == complete(engine, prompts, 6, SamplingParams(temperature=1.0, seed=3), stop_ids=[], batch_size=3)
    stop = together[0][2]
    stopped = complete(engine, prompts[:1], 6, SamplingParams(), stop_ids=[stop])[0]
    assert stopped == together[0][:together[0].index(stop) + 1]


def test_the_teachers_answers_are_written_once_and_read_back(teacher, tmp_path):
    tokenizer = TextTokenizer.bytes()
    tokenizer.chat_template = CHAT_TEMPLATE
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\n\nName a colour.\n")
    writer = ModelSpec(model=teacher, dtype="float32")
    args = dict(writer=writer, writer_digest="t", tokenizer=tokenizer, out_dir=tmp_path / "run", max_new_tokens=5,
                temperature=0.0, seed=0, device=CPU, rank=0, world=1, progress=False)
    texts = answer_texts(f"answers:{prompts}", **args)
    assert [t.split("\n")[0] for t in texts] == ["<user>Say hi.", "<user>Name a colour."]
    assert all(t.count("<assistant>") == 1 and len(t.split("<assistant>")[1].encode()) >= 1 for t in texts)
    (tmp_path / "run" / ANSWERS_FILE).write_text((tmp_path / "run" / ANSWERS_FILE).read_text().replace("Say", "Sing"))
    assert answer_texts(f"answers:{prompts}", **args)[0].startswith("<user>Sing")  # read back, not written again
    with pytest.raises(LadderError, match="other prompts, teacher or settings"):
        answer_texts(f"answers:{prompts}", **{**args, "temperature": 0.5})
    with pytest.raises(LadderError, match="no prompts file"):
        answer_texts("answers:missing.txt", **args)
