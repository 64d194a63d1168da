"""Adaptation the way a practitioner of the Hugging Face stack would do it, against `ladder train`.

SmolLM2-135M-Instruct converted by `ladder convert --ladder-layers N`, loaded in transformers
(`trust_remote_code=True`), its converted layers retrained with transformers' Trainer on the same data
(the Shakespeare training plays, packed the same way) and budget (steps, batch, sequence length,
AdamW, warm-up then cosine to lr/10, clipping) as `experiments/adaptation.py`'s `ladder train` run.
The Trainer draws its own batch order, so the noise to compare with is `ladder train` itself under
another data seed. Held-out perplexity is measured by ladder on each route's saved folder.

    .venv/bin/python experiments/adaptation_transformers.py [--ladder-layers 15] [--steps 60]

Writes results/adaptation_transformers.{jsonl,md}; run folders go to runs/adaptation_transformers/.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from ladder.checkpoint.resolve import open_checkpoint
from ladder.comm.base import LocalCommunicator
from ladder.corpora import python_docs_text, shakespeare_text
from ladder.evaluate import perplexity
from ladder.model.spec import ModelSpec
from ladder.train.data import pack, read_texts
from ladder.train.loop import train
from ladder.train.settings import TrainConfig

CPU = torch.device("cpu")


def heldout_perplexity(folder: Path, texts: dict[str, list[int]]) -> dict[str, float]:
    model = ModelSpec(model=str(folder), dtype="float32").load(LocalCommunicator(), CPU).model.eval()
    return {name: perplexity(model, ids, 512, progress=False)["perplexity"] for name, ids in texts.items()}


def ladder_route(args: argparse.Namespace, n: int, seed: int, runs: Path) -> Path:
    run = runs / f"ladder-train-N{n}-seed{seed}"
    config = TrainConfig(preset=None, model=args.model, layout="ladder", ladder_layers=n,
                         trainable="converted", data=["shakespeare:train"], heldout=[],
                         seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size,
                         micro_batch_size=args.batch_size // 2, lr=args.lr, min_lr=args.lr / 10,
                         warmup_steps=max(1, args.steps // 10), checkpoint_every=args.steps, keep_checkpoints=1,
                         out_dir=str(run), device="cpu", seed=seed)
    return train(config, resume=(run / "checkpoints").is_dir(), progress=True).final_dir


def transformers_route(args: argparse.Namespace, n: int, seed: int, runs: Path) -> Path:
    """`ladder convert`, then transformers only: AutoModelForCausalLM, Trainer, save_pretrained."""
    converted, out = runs / f"converted-N{n}", runs / f"hf-trainer-N{n}-seed{seed}"
    if not converted.is_dir():
        subprocess.run([sys.executable, "-m", "ladder", "convert", args.model, "--ladder-layers", str(n),
                        "--out", str(converted)], check=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(converted), trust_remote_code=True,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted), trust_remote_code=True)
    first = model.config.num_hidden_layers - n
    for name, p in model.named_parameters():  # as ladder's trainable=converted: the converted layers
        p.requires_grad = name.startswith("model.layers.") and int(name.split(".")[2]) >= first
    sequences = pack(read_texts(["shakespeare:train"]), _LadderStyleTokenizer(tokenizer), args.seq_len)
    dataset = [{"input_ids": s, "labels": s} for s in sequences]  # the model shifts the labels itself
    training = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size // 2,
        gradient_accumulation_steps=2, learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.lr / 10}, warmup_steps=max(1, args.steps // 10), weight_decay=0.1,
        adam_beta2=0.95, max_grad_norm=1.0, seed=seed, save_strategy="no", report_to=[], use_cpu=True,
        logging_steps=10, dataloader_num_workers=0)
    transformers.Trainer(model=model, args=training, train_dataset=dataset).train()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


class _LadderStyleTokenizer:
    """The two methods `ladder.train.data.pack` uses, over a transformers tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.eos_token = tokenizer, tokenizer.eos_token

    def token_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_bos)["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ladder-layers", default="15")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens per text")
    parser.add_argument("--runs-dir", default="runs/adaptation_transformers")
    parser.add_argument("--out", default="results/adaptation_transformers.jsonl")
    args = parser.parse_args()
    tokenizer = open_checkpoint(args.model).tokenizer
    texts = {"shakespeare held-out": tokenizer.encode(shakespeare_text("heldout"))[: args.tokens],
             "python docs": tokenizer.encode(python_docs_text())[: args.tokens]}
    runs, records = Path(args.runs_dir), []
    for n in [int(x) for x in args.ladder_layers.split(",")]:
        for route, seed, run in [("ladder train", 0, ladder_route), ("ladder train", 1, ladder_route),
                                 ("transformers Trainer", 0, transformers_route)]:
            start = time.perf_counter()
            folder = run(args, n, seed, runs)
            records.append({"ladder_layers": n, "route": route, "seed": seed, "train_s": time.perf_counter() - start,
                            "ppl": heldout_perplexity(folder, texts), "folder": str(folder)})
            print(json.dumps(records[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    write_table(records, args, out.with_suffix(".md"))


def write_table(records: list[dict], args: argparse.Namespace, path: Path) -> None:
    names = list(records[0]["ppl"])
    lines = ["| ladder on last N | route | seed | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    lines += [f"| {r['ladder_layers']} | {r['route']} | {r['seed']} | " + " | ".join(f"{r['ppl'][k]:.2f}" for k in names)
              + " |" for r in records]
    lines.append("")
    for n in sorted({r["ladder_layers"] for r in records}):
        ladder = [r["ppl"] for r in records if r["ladder_layers"] == n and r["route"] == "ladder train"]
        hf = next(r["ppl"] for r in records if r["ladder_layers"] == n and r["route"] != "ladder train")
        for k in names:
            noise = abs(ladder[0][k] - ladder[1][k])
            gap = abs(hf[k] - sum(x[k] for x in ladder) / len(ladder))
            lines.append(f"- N={n}, {k}: Trainer vs the mean of ladder's seeds {gap:.2f}; "
                         f"ladder seed 0 vs seed 1 {noise:.2f}")
    lines.append(f"\nBoth routes: {args.steps} steps x {args.batch_size} sequences x {args.seq_len} tokens of the "
                 f"Shakespeare training plays, converted layers only, AdamW lr {args.lr} (warm-up, cosine to "
                 f"lr/10), weight decay 0.1, betas (0.9, 0.95), clipping 1.0; held-out perplexity by ladder on "
                 f"{args.tokens} tokens per text. transformers {transformers.__version__}.")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
