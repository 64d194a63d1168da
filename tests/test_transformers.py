"""Ladder folders in transformers: SmolLM2-135M-Instruct's real weights converted as `ladder convert` does
run in transformers (trust_remote_code) exactly as in ladder; generation, training, PEFT and saving
work there; a standard folder stays a plain Llama; the reference implementation's format is read."""

import json
import subprocess
import sys

import pytest
import torch

from ladder.checkpoint.hf import save_hf
from ladder.checkpoint.hf_config import REMOTE_CODE_FILES
from ladder.checkpoint.tokenizer import CHAT_TEMPLATE_FILE, TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.errors import LadderError
from ladder.model.config import get_preset
from ladder.model.spec import ModelSpec
from ladder.model.weights import export_hf_state_dict, random_model
from ladder.runtime.engine import Engine

from helpers import ladder_in_process

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CPU = torch.device("cpu")
SMOLLM = "smollm2-135m-instruct"  # 30 layers
LAYOUTS = {"standard": (None, None), "ladder": ("ladder", None), "hybrid-10": ("ladder", 10),
           "hybrid-20": ("ladder", 20)}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """SmolLM2 converted to each layout, and a random tiny model in the parallel layout
    (a checkpoint trained with two norms per layer cannot become parallel)."""
    root = tmp_path_factory.mktemp("converted")
    made = {}
    for name, (layout, n) in LAYOUTS.items():  # what `ladder convert` does (which a test below runs too)
        loaded = ModelSpec(model=SMOLLM, layout=layout, ladder_layers=n, dtype="float32").load(LocalCommunicator(), CPU)
        made[name] = save_hf(root / name, loaded.model.config, export_hf_state_dict(loaded.model), loaded.tokenizer)
    tiny = random_model(get_preset("tiny", layout="parallel"), LocalCommunicator(), CPU)
    made["parallel"] = save_hf(root / "parallel", tiny.config, export_hf_state_dict(tiny), None)
    return made


def hf_model(folder, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True,
                                                             dtype=kwargs.pop("dtype", torch.float32), **kwargs).eval()


def ladder_model(folder):
    return ModelSpec(model=str(folder), dtype="float32").load(LocalCommunicator(), CPU)


def chat_ids(folder) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return torch.tensor([ids])


# ---- the same function in both ------------------------------------------------------------------

@pytest.mark.parametrize("layout", [*LAYOUTS, "parallel"])
def test_transformers_computes_what_ladder_computes(folders, layout):
    loaded = ladder_model(folders[layout])
    tokens = chat_ids(folders[layout]) if layout != "parallel" else torch.randint(0, 256, (2, 16))
    model = hf_model(folders[layout])
    expected_class = "LlamaForCausalLM" if layout == "standard" else "LadderLlamaForCausalLM"
    assert type(model).__name__ == expected_class
    with torch.no_grad():
        theirs, ours = model(tokens).logits, loaded.model(tokens)
    assert (theirs - ours).abs().max().item() < 1e-4


def test_the_converted_layouts_compute_different_functions(folders):
    """The comparison above could pass by both sides ignoring the layout: they do not."""
    tokens = chat_ids(folders["standard"])
    with torch.no_grad():
        logits = {name: hf_model(folders[name])(tokens).logits for name in LAYOUTS}
    for a, b in [("standard", "hybrid-10"), ("hybrid-10", "hybrid-20"), ("hybrid-20", "ladder")]:
        assert (logits[a] - logits[b]).abs().max().item() > 1e-2


@pytest.mark.parametrize("layout", ["ladder", "hybrid-10"])
def test_cached_generate_equals_a_full_forward_and_ladders_greedy_answer(folders, layout):
    model, prompt = hf_model(folders[layout]), chat_ids(folders[layout])
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, prompt.shape[1]:]
    with torch.no_grad():
        full = model(out.sequences).logits[0, prompt.shape[1] - 1:-1]
    assert (torch.stack(out.logits, 1)[0] - full).abs().max().item() < 1e-4
    # ladder's own engine, greedy, on the same chat prompt (its own template rendering): the same tokens
    loaded = ladder_model(folders[layout])
    text = loaded.tokenizer.render_chat([{"role": "user", "content": QUESTION}])
    ours = torch.tensor([loaded.tokenizer.encode(text, add_bos=False)])
    assert ours.tolist() == prompt.tolist()
    answer = Engine(loaded.model).generate(ours, max_new_tokens=12).tokens[0]
    assert answer == generated.tolist()[:len(answer)] and len(answer) >= 1


def test_hidden_states_eager_and_sdpa_and_bf16(folders):
    tokens = chat_ids(folders["hybrid-10"])
    sdpa, eager = (hf_model(folders["hybrid-10"], attn_implementation=a) for a in ("sdpa", "eager"))
    with torch.no_grad():
        out = sdpa(tokens, output_hidden_states=True)
        assert (eager(tokens).logits - out.logits).abs().max().item() < 1e-4
    assert len(out.hidden_states) == 31  # the embeddings, the input of every later layer, the normed output
    assert torch.equal(out.hidden_states[0], sdpa.model.embed_tokens(tokens))
    assert torch.equal(out.hidden_states[-1], sdpa.model(tokens).last_hidden_state)
    # On the first 20 (standard) layers the residual stream is Llama's own
    with torch.no_grad():
        llama = hf_model(folders["standard"])(tokens, output_hidden_states=True).hidden_states
    assert all(torch.allclose(llama[i], out.hidden_states[i], atol=1e-4) for i in range(21))
    assert not torch.allclose(llama[22], out.hidden_states[22], atol=1e-2)
    bf16 = hf_model(folders["hybrid-10"], dtype=torch.bfloat16)
    assert bf16.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert bf16(tokens).logits[0, -1].argmax() == out.logits[0, -1].argmax()


# ---- training through transformers ------------------------------------------------------------------

def _train_step(model, tokens) -> tuple[float, float]:
    """One AdamW step on `tokens` as labels; the loss before and after."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = model(tokens, labels=tokens).loss
    return loss.item(), after.item()


def test_a_training_step_with_gradient_checkpointing_trains_the_converted_layers(folders):
    tokens = chat_ids(folders["hybrid-10"])
    plain, checkpointed = hf_model(folders["hybrid-10"]), hf_model(folders["hybrid-10"])
    # transformers 5.24 renamed it (the old name warns); 5.17 has the old one only
    getattr(checkpointed, "activation_checkpointing_enable", checkpointed.gradient_checkpointing_enable)()
    for model in (plain, checkpointed):
        model.train()
        model(tokens, labels=tokens).loss.backward()
    for name, p in plain.named_parameters():  # recomputed, the same gradients
        q = dict(checkpointed.named_parameters())[name]
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    converted = plain.model.layers[25].self_attn.q_proj.weight.grad
    assert converted is not None and converted.abs().sum() > 0
    before, after = _train_step(hf_model(folders["hybrid-10"]), tokens)
    assert after < before


def test_a_peft_lora_step_trains_adapters_on_the_converted_layers(folders):
    peft = pytest.importorskip("peft")
    tokens = chat_ids(folders["hybrid-10"])
    model = peft.get_peft_model(hf_model(folders["hybrid-10"]),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    before, after = _train_step(model, tokens)
    assert after != before
    lora = [p for n, p in model.named_parameters() if ".layers.25." in n and "lora_" in n]
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


# ---- folders: saving, round trips, refusals -------------------------------------------------------------

def _tensors(folder) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(folder / "model.safetensors"))


def test_save_reload_and_ladder_convert_round_trip_bit_exactly(folders, tmp_path, capsys):
    original = _tensors(folders["hybrid-20"])
    hf_model(folders["hybrid-20"]).save_pretrained(tmp_path / "saved")
    saved = _tensors(tmp_path / "saved")
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "ladder_llama" and config["ladder_layers"] == 20
    assert type(hf_model(tmp_path / "saved")).__name__ == "LadderLlamaForCausalLM"
    result = ladder_in_process(capsys, "convert", str(tmp_path / "saved"), "--out", str(tmp_path / "again"))
    assert result.returncode == 0, result.stderr
    again = _tensors(tmp_path / "again")
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in again)
    assert "hybrid (ladder on last 20 of 30 layers)" in result.stdout


def test_a_ladder_folder_carries_its_code_and_a_standard_one_stays_llama(folders):
    assert all((folders["ladder"] / name).is_file() for name in REMOTE_CODE_FILES)
    assert "trust_remote_code=True" in (folders["ladder"] / "README.md").read_text()
    assert not any((folders["standard"] / name).exists() for name in REMOTE_CODE_FILES)
    assert json.loads((folders["standard"] / "config.json").read_text())["model_type"] == "llama"
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(folders["standard"]))  # no remote code
    assert type(plain).__name__ == "LlamaForCausalLM"


def test_without_trust_remote_code_transformers_refuses_a_ladder_folder(folders):
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(str(folders["ladder"]), trust_remote_code=False)


@pytest.mark.slow
def test_the_folder_runs_where_ladder_is_not_installed(folders):
    """The modeling code imports nothing from ladder: transformers runs it with ladder unimportable."""
    script = ("import sys; sys.modules['ladder'] = None\n"
              "import torch, transformers\n"
              f"m = transformers.AutoModelForCausalLM.from_pretrained({str(folders['ladder'])!r}, trust_remote_code=True)\n"
              "print(type(m).__name__, m(torch.tensor([[1, 2, 3]])).logits.shape)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "LadderLlamaForCausalLM torch.Size([1, 3, 49152])" in result.stdout


def test_a_desync_folder_says_in_one_line_why_transformers_cannot_run_it(tmp_path):
    tiny = random_model(get_preset("tiny", layout="desync"), LocalCommunicator(), CPU)
    folder = save_hf(tmp_path / "desync", tiny.config, export_hf_state_dict(tiny), None)
    with pytest.raises(ValueError, match=r"^residual_layout 'desync' cannot run in transformers: .*ladder generate"):
        hf_model(folder)
    assert ladder_model(folder).model.config.layout == "desync"  # ladder reads it back


# ---- the reference implementation's format ------------------------------------------------------------

def _reference_folder(tmp_path, ladder_layers):
    """A small checkpoint in the shape the paper's code writes: a Llama config with model_type
    "llamaLadder" and `ladder_layers` as layer indices (or a count), Llama tensor names."""
    tiny = random_model(get_preset("tiny"), LocalCommunicator(), CPU)
    folder = save_hf(tmp_path / f"reference-{ladder_layers}", tiny.config, export_hf_state_dict(tiny), None)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "llamaLadder", "architectures": ["LlamaLadderForCausalLM"], "ladder_layers": ladder_layers}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tiny


@pytest.mark.parametrize("ladder_layers", [[2, 3], 2])
def test_the_reference_format_runs_as_the_hybrid_it_describes(tmp_path, ladder_layers):
    folder, tiny = _reference_folder(tmp_path, ladder_layers)
    loaded = ladder_model(folder)
    assert loaded.model.config.layout == "ladder" and loaded.model.config.n_ladder_layers == 2
    hybrid = random_model(get_preset("tiny", layout="ladder", ladder_layers=2), LocalCommunicator(), CPU)
    tokens = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), hybrid(tokens))
        assert not torch.allclose(loaded.model(tokens), tiny(tokens))


def test_reference_ladder_layers_other_than_the_last_ones_are_refused(tmp_path):
    folder, _ = _reference_folder(tmp_path, [1, 3])
    with pytest.raises(LadderError, match=r"ladder_layers \[1, 3\] are not the last 2 of 4 layers"):
        ladder_model(folder)
    folder, _ = _reference_folder(tmp_path / "none", [])
    assert ladder_model(folder).model.config.layout == "standard"


def test_a_left_padded_batch_generates_what_each_prompt_generates_alone(tmp_path):
    tiny = random_model(get_preset("tiny", layout="ladder", ladder_layers=3), LocalCommunicator(), CPU)
    model = hf_model(save_hf(tmp_path / "tiny", tiny.config, export_hf_state_dict(tiny), None),
                     attn_implementation="eager")
    short, long = [5, 6, 7], [9, 10, 11, 12, 13, 14]
    batch = torch.tensor([[0] * 3 + short, long])
    mask = torch.tensor([[0] * 3 + [1] * 3, [1] * 6])
    together = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for row, prompt in enumerate([short, long]):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert together[row, 6:].tolist() == alone[0, len(prompt):].tolist()
    with torch.no_grad():
        attentions = model(torch.tensor([long]), output_attentions=True).attentions
    assert len(attentions) == 4 and attentions[0].shape == (1, 4, 6, 6)  # (batch, heads, query, key) per layer


def test_a_chat_template_transformers_saved_in_its_own_file_is_read_and_written_where_transformers_reads_it(
        folders, tmp_path):
    """transformers 5 saves a tokenizer's chat template in chat_template.jinja, not in tokenizer_config.json.
    ladder reads it there (`generate --chat` renders it), and a converted folder keeps it where transformers
    and vLLM read it."""
    saved = tmp_path / "saved-by-transformers"
    hf_model(folders["standard"]).save_pretrained(saved)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folders["standard"]))
    tokenizer.save_pretrained(saved)
    assert (saved / CHAT_TEMPLATE_FILE).is_file()
    assert not json.loads((saved / "tokenizer_config.json").read_text()).get("chat_template")
    question = [{"role": "user", "content": QUESTION}]
    expected = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    assert TextTokenizer.from_hf_folder(saved).render_chat(question) == expected

    loaded = ModelSpec(model=str(saved), layout="ladder", ladder_layers=8, dtype="float32").load(LocalCommunicator(), CPU)
    converted = save_hf(tmp_path / "converted", loaded.model.config, export_hf_state_dict(loaded.model), loaded.tokenizer)
    again = transformers.AutoTokenizer.from_pretrained(str(converted))
    assert again.apply_chat_template(question, add_generation_prompt=True, tokenize=False) == expected
