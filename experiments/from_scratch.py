"""The paper's first quality claim at small scale: standard, parallel and ladder models of one shape,
trained from scratch on the same data, token budget and seeds; held-out perplexity of each. Desync is
trained for TP 2 (two ranks simulated, attention all-reduces dropped) and evaluated as two ranks.

    .venv/bin/python experiments/from_scratch.py [--steps 300] [--seeds 0,1]

Data: Shakespeare, modern-spelling edition only, split by play (held out: The Tempest, Macbeth,
Twelfth Night). Byte-level tokens, the `byte-4m` preset. Writes results/from_scratch.{jsonl,md} and
results/from_scratch.png; run folders go to runs/from_scratch/.
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from ladder.train.loop import train
from ladder.train.plot import plot_training
from ladder.train.settings import TrainConfig

LAYOUTS = ("standard", "parallel", "ladder", "desync")
LABELS = {"desync": "desync (TP 2, MLP reduces only)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--preset", default="byte-4m")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--runs-dir", default="runs/from_scratch")
    parser.add_argument("--out", default="results/from_scratch.jsonl")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    records = []
    for seed in seeds:
        for layout in LAYOUTS:
            run = Path(args.runs_dir) / f"{layout}-seed{seed}"
            config = TrainConfig(preset=args.preset, layout=layout, desync_tp=2 if layout == "desync" else None,
                                 data=["shakespeare:train"],
                                 heldout=["shakespeare:heldout"], seq_len=args.seq_len, steps=args.steps,
                                 batch_size=args.batch_size, micro_batch_size=args.batch_size, lr=3e-3, min_lr=3e-4,
                                 warmup_steps=max(1, args.steps // 20), seed=seed, out_dir=str(run),
                                 checkpoint_every=max(1, args.steps // 2), eval_every=max(1, args.steps // 4),
                                 eval_batches=32, device="cpu")
            start = time.perf_counter()
            result = train(config, resume=(run / "checkpoints").is_dir(), progress=True)
            records.append({"layout": layout, "seed": seed, "steps": args.steps, "preset": args.preset,
                            "tokens": args.steps * args.batch_size * args.seq_len, "eval_loss": result.eval_loss,
                            "eval_ppl": math.exp(result.eval_loss), "seconds": time.perf_counter() - start,
                            "run": str(run)})
            print(json.dumps(records[-1]), flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = ["| layout | held-out perplexity (bytes), per seed | mean | vs standard |", "|---|---|---|---|"]
    base = statistics.mean(r["eval_ppl"] for r in records if r["layout"] == "standard")
    for layout in LAYOUTS:
        ppl = [r["eval_ppl"] for r in records if r["layout"] == layout]
        lines.append(f"| {LABELS.get(layout, layout)} | {', '.join(f'{p:.3f}' for p in ppl)} | "
                     f"{statistics.mean(ppl):.3f} | {statistics.mean(ppl) / base - 1:+.1%} |")
    r0 = records[0]
    lines.append(f"\n{args.preset}, {r0['tokens']:,} training tokens per run ({args.steps} steps x {args.batch_size} x "
                 f"{args.seq_len} bytes), seeds {args.seeds}; held-out: Shakespeare plays never seen in training.")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(plot_training([Path(r["run"]) for r in records], out.with_suffix(".png")))


if __name__ == "__main__":
    main()
