"""The paper's second quality claim at small scale: a pretrained model converted to ladder on its last
N layers loses quality that a short retraining recovers.

SmolLM2-135M-Instruct, ladder on the last N layers (default 8 and 15 of 30), retrained with only the
converted layers trainable on the Shakespeare training plays. Held-out perplexity (Shakespeare plays
never trained on, and Python's documentation prose as an out-of-domain check) before conversion, right
after, and after retraining; the same retraining applied to the unconverted model (N=0) is the control
for what the text itself teaches. Greedy answers to fixed chat prompts show quality, not only a number.

    .venv/bin/python experiments/adaptation.py [--ladder-layers 8,15] [--steps 60]

Writes results/adaptation.{jsonl,md}; run folders go to runs/adaptation/.
"""

import argparse
import json
from pathlib import Path

import torch

from ladder.checkpoint.resolve import open_checkpoint
from ladder.comm.base import LocalCommunicator
from ladder.corpora import python_docs_text, shakespeare_text
from ladder.evaluate import perplexity
from ladder.model.spec import with_layout
from ladder.model.weights import DictSource, build_model, export_hf_state_dict, load_weights
from ladder.runtime.engine import Engine
from ladder.train.loop import train
from ladder.train.settings import TrainConfig

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Who wrote Romeo and Juliet?"]


def evaluate(model, tokenizer, texts: dict[str, list[int]]) -> dict[str, float]:
    return {name: perplexity(model.eval(), ids, 512, progress=False)["perplexity"] for name, ids in texts.items()}


def answers(model, tokenizer) -> list[str]:
    engine, out = Engine(model.eval()), []
    for prompt in PROMPTS:
        ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": prompt}]), add_bos=False)
        result = engine.generate(torch.tensor([ids]), 24, stop_ids=tokenizer.stop_ids)
        out.append(tokenizer.decode(result.tokens[0]).strip())
    return out


def load(folder_or_name: str, ladder_layers: int | None = None):
    checkpoint = open_checkpoint(folder_or_name)
    config = with_layout(checkpoint.config, "ladder", ladder_layers) if ladder_layers is not None else checkpoint.config
    model = build_model(config, LocalCommunicator(), torch.device("cpu"))
    load_weights(model, checkpoint.source)
    return model, checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ladder-layers", default="8,15")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens per text")
    parser.add_argument("--runs-dir", default="runs/adaptation")
    parser.add_argument("--out", default="results/adaptation.jsonl")
    parser.add_argument("--table-only", action="store_true", help="rewrite the .md from an existing .jsonl")
    args = parser.parse_args()
    if args.table_only:
        write_table([json.loads(line) for line in Path(args.out).read_text().splitlines()], args)
        return

    base, checkpoint = load(args.model)
    tokenizer = checkpoint.tokenizer
    texts = {"shakespeare held-out": tokenizer.encode(shakespeare_text("heldout"))[: args.tokens],
             "python docs": tokenizer.encode(python_docs_text())[: args.tokens]}
    weights = DictSource(export_hf_state_dict(base))
    records = [{"ladder_layers": 0, "stage": "pretrained", "ppl": evaluate(base, tokenizer, texts),
                "answers": answers(base, tokenizer)}]
    print(json.dumps(records[-1]), flush=True)
    for n in [0] + [int(x) for x in args.ladder_layers.split(",")]:
        if n:
            converted = build_model(with_layout(checkpoint.config, "ladder", n), LocalCommunicator(), torch.device("cpu"))
            load_weights(converted, weights)
            records.append({"ladder_layers": n, "stage": "converted", "ppl": evaluate(converted, tokenizer, texts),
                            "answers": answers(converted, tokenizer)})
            print(json.dumps(records[-1]), flush=True)
        run = Path(args.runs_dir) / f"ladder{n}"
        config = TrainConfig(preset=None, model=args.model, layout="ladder", ladder_layers=n,
                             trainable="converted" if n > 0 else "all", data=["shakespeare:train"], heldout=[],
                             seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size,
                             micro_batch_size=args.batch_size // 2, lr=args.lr, min_lr=args.lr / 10,
                             warmup_steps=max(1, args.steps // 10), checkpoint_every=args.steps, keep_checkpoints=1,
                             out_dir=str(run), device="cpu")
        result = train(config, resume=(run / "checkpoints").is_dir(), progress=True)
        retrained, _ = load(str(result.final_dir))
        records.append({"ladder_layers": n, "stage": "retrained" if n else "retrained (control, unconverted)",
                        "ppl": evaluate(retrained, tokenizer, texts), "answers": answers(retrained, tokenizer),
                        "train_tokens": args.steps * args.batch_size * args.seq_len,
                        "trainable": "ladder layers only" if n else "all parameters"})
        print(json.dumps(records[-1]), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    write_table(records, args)


def write_table(records: list[dict], args: argparse.Namespace) -> None:
    """results/adaptation.md from the records: perplexities, the share recovered, every answer."""
    names = list(records[0]["ppl"])
    lines = ["| ladder on last N | stage | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in records:
        cells = " | ".join(f"{r['ppl'][name]:.2f}" for name in names)
        lines.append(f"| {r['ladder_layers']} | {r['stage']} | {cells} |")
    # Retraining on Shakespeare also teaches the text itself (the unconverted control improves too), so
    # the converted model is compared with the unconverted one trained the same way, not with the original.
    pre = records[0]["ppl"]
    control = next((r["ppl"] for r in records if r["ladder_layers"] == 0 and r["stage"] != "pretrained"), None)
    lines.append("\nPerplexity gap to the unconverted model (after retraining: to the control retrained the same way):\n")
    for n in sorted({r["ladder_layers"] for r in records if r["stage"] == "converted"}):
        conv = next(r for r in records if r["ladder_layers"] == n and r["stage"] == "converted")["ppl"]
        ret = next(r for r in records if r["ladder_layers"] == n and r["stage"] == "retrained")["ppl"]
        parts = []
        for name in names:
            before, after = conv[name] / pre[name] - 1, ret[name] / (control or pre)[name] - 1
            parts.append(f"{name} {before:+.0%} -> {after:+.0%} ({1 - after / before:.0%} of the gap closed)")
        lines.append(f"- N={n}: " + "; ".join(parts))
    trained = next(r for r in records if "train_tokens" in r)
    lines.append(f"\nRetraining: {trained['train_tokens']:,} tokens of the Shakespeare training plays "
                 f"({args.steps} steps x {args.batch_size} x {args.seq_len}), lr {args.lr}, converted layers only "
                 f"(the N=0 control: all parameters); held-out perplexity on {args.tokens} tokens per text.")
    lines.append("\nGreedy answers (24 new tokens at most):\n")
    lines.append("| ladder on last N | stage | " + " | ".join(PROMPTS) + " |")
    lines.append("|---|---|" + "---|" * len(PROMPTS))
    for r in records:
        answers = " | ".join(a.replace("|", "\\|").replace("\n", " ") for a in r["answers"])
        lines.append(f"| {r['ladder_layers']} | {r['stage']} | {answers} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
