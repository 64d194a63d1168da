"""ladder eval: the windows score every token once, the perplexity is transformers' loss, TP 2 (torchrun) = TP 1."""

import json
import math

import pytest
import torch

from ladder.checkpoint.resolve import open_checkpoint
from ladder.comm.base import LocalCommunicator
from ladder.evaluate import perplexity, windows
from ladder.model.weights import build_model, load_weights

from helpers import CPU, ladder_in_process, ladder_lines, torchrun_ladder, torchrun_on_two_nodes


@pytest.mark.parametrize("n_tokens,window,stride", [(2, 2, 1), (10, 4, 3), (10, 4, 1), (100, 16, 7), (17, 512, 512)])
def test_windows_score_every_token_but_the_first_exactly_once(n_tokens, window, stride):
    scored = []
    for begin, end, first in windows(n_tokens, window, stride):
        assert end - begin <= window and begin < first <= end  # at least one token of context
        scored += range(first, end)
    assert scored == list(range(1, n_tokens))


def test_perplexity_is_the_exp_of_transformers_loss(tiny_hf):
    reference, folder, _ = tiny_hf
    checkpoint = open_checkpoint(str(folder))
    model = build_model(checkpoint.config, LocalCommunicator(), CPU)
    load_weights(model, checkpoint.source)
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        loss = float(reference(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    whole = perplexity(model.eval(), ids, window=len(ids), progress=False)
    assert whole["n_scored"] == len(ids) - 1
    assert whole["nll_per_token"] == pytest.approx(loss, rel=1e-5)
    assert whole["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    # Shorter windows give each token less context, so another value, over the same tokens.
    chunked = perplexity(model, ids, window=16, progress=False)
    assert chunked["n_scored"] == len(ids) - 1 and chunked["perplexity"] != pytest.approx(whole["perplexity"])


@pytest.mark.parametrize("args,message", [
    (["--stride", "0"], "--stride must be between 1 and --window (512), got 0"),
    (["--max-tokens", "1"], "--max-tokens must be >= 2"),
    (["--text", "/no/such.txt"], "no text file at /no/such.txt"),
])
def test_eval_bad_input_is_one_line(args, message, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world")
    out = ladder_in_process(capsys, "eval", "--preset", "tiny", "--text", str(text), *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert message in lines[0]


@pytest.mark.slow
def test_eval_at_tp_2_under_torchrun_equals_tp_1_and_reports_once(tmp_path, capsys):
    text = tmp_path / "play.txt"
    text.write_text("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 4)
    args = ["eval", "--model", "smollm2-135m-instruct", "--text", str(text), "--max-tokens", "60", "--window", "32",
            "--stride", "16", "--json"]
    tp2 = torchrun_ladder(*args, "--tp", "2", dist_timeout_s=120)
    tp1 = ladder_in_process(capsys, *args)  # TP 1 starts no workers
    assert tp1.returncode == 0 and tp2.returncode == 0, tp2.stderr[-2000:]
    reports = [json.loads(line) for line in tp2.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1  # printed by global rank 0 only
    one, two = json.loads(tp1.stdout.strip().splitlines()[-1]), reports[0]
    assert one["n_scored"] == two["n_scored"] == 59 and one["stride"] == 16 and two["tp"] == 2
    assert two["perplexity"] == pytest.approx(one["perplexity"], rel=1e-4)
    assert 1 < one["perplexity"] < 100  # a real model on English text, not random weights (~49152)


@pytest.mark.slow
def test_two_nodes_reading_different_texts_stop_with_one_line_each(tmp_path):
    """`--text` names a file on each machine: two different files would be scored as one."""
    for node, words in enumerate(["To be, or not to be", "Now is the winter of our discontent"]):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "play.txt").write_text(words * 4)
    args = ["eval", "--model", "smollm2-135m-instruct", "--text", "play.txt", "--max-tokens", "20", "--tp", "2"]
    nodes = torchrun_on_two_nodes([args, args], [tmp_path / "node0", tmp_path / "node1"])
    for rank, (status, _, err) in enumerate(nodes):
        assert status != 0
        assert ladder_lines(err, "ladder: error") == [
            f"ladder: error: rank {1 - rank} and rank {rank} have different options or tokens of --text: start every "
            "node with the same command and the same files"], err[-3000:]
