"""Adaptation by distillation against today's cross-entropy recipe, and which N to pick.

SmolLM2-135M-Instruct converted to ladder on its last N of 30 layers, then trained (the converted
layers only) for one budget of minutes on this machine's two cores (`--minutes`: the steps that fit,
from the speed of a few steps measured first), by one of two recipes:
- distill: the unconverted model as teacher, KL on logits (T = 1) plus residual matching after each
  converted layer, on the teacher's own answers to 1,024 built-in prompts and the Shakespeare training
  plays, half and half (`ladder train teacher=original ...`), bf16 autocast (fp32 on a CPU without bf16
  arithmetic, which emulates it 20x slower); `--data` draws from other sources in equal shares (`--tag
  mix`: the standard library's source as a third, technical text that is not the held-out documentation
  prose);
- ce: the recipe before distillation (docs/training.md), cross-entropy on the Shakespeare training plays,
  for the same minutes;
- calibrate: the distill recipe's start alone, its first `--calibrate-tokens` (default 16,384) fitted in
  closed form (`ladder.train.calibrate`), no training step. `--calibrate-tokens N` on distill starts it
  there (its minutes count the calibration; `--tag calibrated` names that recipe).
Each is measured against the ORIGINAL model on text no training step saw (three held-out plays, and
Python's documentation prose): perplexity, greedy next-token agreement and mean KL, and the greedy chat
answers to 24 prompts that are not among the training prompts. Beside each N: the speedup `ladder
predict` gives the same share of Llama-3-70B's 80 layers at TP 8 on H100, with NVLink and over PCIe
without P2P.

    .venv/bin/python experiments/distillation.py --recipes distill,ce --ladder-layers 8,15
    .venv/bin/python experiments/distillation.py --recipes distill --ladder-layers 4,12,20,30
    .venv/bin/python experiments/distillation.py --recipes calibrate --ladder-layers 4,8,12,15,20,30
    .venv/bin/python experiments/distillation.py --recipes distill --ladder-layers 8 --calibrate-tokens 16384 \
        --lr 1.5e-4 --steps 540 --tag calibrated         # (540: the steps 28 minutes held at N=8)
    .venv/bin/python experiments/distillation.py --recipes distill --ladder-layers 15 --calibrate-tokens 16384 \
        --lr 1.5e-4 --tag calibrated
    .venv/bin/python experiments/distillation.py --recipes distill --ladder-layers 8,15 \
        --data answers:builtin,shakespeare:train,python-source --tag mix    # a third of Python's own source
    .venv/bin/python experiments/distillation.py --lm-eval       # lm-eval's offline tasks on every run's model
    .venv/bin/python experiments/distillation.py --references    # the original against its rounded copies
    .venv/bin/python experiments/distillation.py --report        # the table and picture from the results

Writes results/distillation.{jsonl,md,png} (a record per recipe and N, replaced when re-run); run
folders go to runs/distill/. The teacher's answers are written once (runs/distill/answers) and copied
into each run's folder.
"""

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch

from ladder.comm.base import LocalCommunicator
from ladder.comm.links import get_link
from ladder.corpora import python_docs_text, shakespeare_text
from ladder.evaluate import compare, perplexity
from ladder.harness import ladder_lm, task_manager
from ladder.model.config import cpu_computes_in_bf16
from ladder.model.spec import ModelSpec
from ladder.predict.costmodel import get_gpu, predict_table
from ladder.quant.quantize import block_linears
from ladder.runtime.completions import complete
from ladder.runtime.engine import Engine
from ladder.runtime.sampling import SamplingParams
from ladder.train.answers import ANSWERS_FILE, answer_texts
from ladder.train.distill import ORIGINAL, load_teacher, teacher_spec
from ladder.train.loop import train
from ladder.train.plot import plot_quality_against_speed
from ladder.train.prompts import CHAT_EVAL
from ladder.train.settings import TrainConfig

MODEL = "smollm2-135m-instruct"
CPU = torch.device("cpu")
TARGETS = {8: (0.03, 0.90), 15: (0.08, 0.85)}  # N: (perplexity within, agreement at least)
DOMAINS = {"shakespeare held-out": lambda: shakespeare_text("heldout"), "python docs": python_docs_text}
LLAMA_70B_LAYERS = 80
SWEEP = (0, 4, 8, 12, 15, 20, 30)  # the N of "which N to pick"
FRONT_SERIES = {"calibrate": "calibrated, no training", "distill": "distilled (28 min)",
                "distill-calibrated": "calibrated, then distilled (28 min)"}  # recipe: its label in "which N"
CALIBRATION_S = 75  # per 16,384 tokens on these two cores (68 s measured): planned out of the budget
# The original with its weights rounded as users already run it: how close "close" is (`--references`)
REFERENCE = "reference: "  # the recipe of a reference record, before its label


def recipe_config(recipe: str, n: int, steps: int, args: argparse.Namespace, out_dir: Path) -> TrainConfig:
    common = dict(preset=None, model=MODEL, layout="ladder", ladder_layers=n, trainable="converted" if n else "all",
                  heldout=[], steps=steps, warmup_steps=10, checkpoint_every=50, keep_checkpoints=1,
                  out_dir=str(out_dir), device="cpu")
    if recipe == "calibrate":  # the distill recipe's start: its first tokens fitted in closed form, no step
        config = recipe_config("distill", n, steps, args, out_dir)
        return dataclasses.replace(config, steps=0, calibrate_tokens=args.calibrate_tokens or 16384)
    if recipe == "distill":
        sources = args.data.split(",")
        return TrainConfig(**common, teacher=ORIGINAL, hidden_weight=args.hidden_weight, lr=args.lr,
                           min_lr=args.lr / 10, data=sources, data_weights=[1.0] * len(sources),
                           seq_len=args.seq_len, batch_size=args.batch_size, micro_batch_size=args.batch_size // 2,
                           precision="bf16" if cpu_computes_in_bf16() else "fp32", weight_decay=0.0,
                           calibrate_tokens=args.calibrate_tokens)
    if recipe == "ce":  # docs/training.md's adaptation before distillation (experiments/adaptation.py)
        return TrainConfig(**common, lr=2e-4, min_lr=2e-5, data=["shakespeare:train"], seq_len=128, batch_size=8,
                           micro_batch_size=4)
    raise SystemExit(f"unknown recipe {recipe!r}")


def steps_for(recipe: str, n: int, args: argparse.Namespace) -> tuple[int, float]:
    """The steps that fit `--minutes` (or `--steps`), from the tokens/s of a few steps run first (the
    first two, which warm up, not counted); and that speed."""
    if recipe == "calibrate":
        return 0, 0.0
    if args.steps:
        return args.steps, 0.0
    probe = Path(args.runs_dir) / f"probe-{recipe}-n{n}"
    shutil.rmtree(probe, ignore_errors=True)
    probe.mkdir(parents=True)
    if recipe == "distill":
        shutil.copy(Path(args.runs_dir) / "answers" / ANSWERS_FILE, probe / ANSWERS_FILE)
    config = dataclasses.replace(recipe_config(recipe, n, 6, args, probe), calibrate_tokens=0)
    train(config, progress=False)
    rows = [json.loads(line) for line in (probe / "metrics.jsonl").read_text().splitlines()][2:]
    shutil.rmtree(probe)
    rate = sum(r["tokens_per_s"] for r in rows) / len(rows)
    seconds = args.minutes * 60 - CALIBRATION_S * args.calibrate_tokens / 16384 if recipe == "distill" else args.minutes * 60
    return int(seconds * rate / (config.batch_size * config.seq_len)), rate


def held_out(tokenizer, tokens: int) -> dict[str, list[int]]:
    return {name: tokenizer.encode(text())[:tokens] for name, text in DOMAINS.items()}


def chat_answers(model, tokenizer, max_new_tokens: int) -> list[str]:
    prompts = [tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": p}]), add_bos=False)
               for p in CHAT_EVAL]
    answers = complete(Engine(model), prompts, max_new_tokens, SamplingParams(), tokenizer.stop_ids,
                       batch_size=len(prompts))
    return [tokenizer.decode(a).strip() for a in answers]


def load(name: str):
    return ModelSpec(model=name, dtype="float32").load(LocalCommunicator(), CPU)


def write_answers(args: argparse.Namespace, tokenizer) -> tuple[Path, float]:
    """The teacher's answers to the built-in prompts, once for every run (and how long they took)."""
    folder = Path(args.runs_dir) / "answers"
    path = folder / ANSWERS_FILE
    config = TrainConfig(model=MODEL, teacher=ORIGINAL)
    spec = teacher_spec(ORIGINAL, MODEL, "cpu")
    _, digest = load_teacher(spec, CPU, load(MODEL).model, tokenizer)  # its identity keys the answers
    start = time.perf_counter()
    answer_texts("answers:builtin", spec, digest, tokenizer, folder, config.answers_max_tokens,
                 config.answers_temperature, config.seed, CPU, 0, 1)
    seconds = time.perf_counter() - start
    if seconds > 5:  # written now, not read back
        (folder / "seconds.json").write_text(json.dumps({"seconds": seconds}))
    return path, json.loads((folder / "seconds.json").read_text())["seconds"]


def train_minutes(run: Path) -> tuple[float, int, float]:
    """Minutes the calibration and optimizer steps took (from the run's own records, resumed runs included), tokens, and the
    minutes of steps stopped from outside (SIGSTOP while the test suite had the cores: a step over ten
    times the median, counted beyond the median)."""
    metrics = run / "metrics.jsonl"  # none: calibrated only
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    seconds = [r["tokens"] / r["step"] / r["tokens_per_s"] for r in records]
    typical = statistics.median(seconds) if seconds else 0.0
    stopped = sum(s - typical for s in seconds if s > 10 * typical)
    calibration = run / "calibration.json"  # counted in the budget
    calibrated = json.loads(calibration.read_text())["seconds"] if calibration.is_file() else 0.0
    return (sum(seconds) + calibrated) / 60, records[-1]["tokens"] if records else 0, stopped / 60


def predicted_speedups(n: int) -> dict[str, float]:
    """The speedup of ladder on the same share of Llama-3-70B's layers (TP 8, H100, batch 1), per link."""
    layers = round(LLAMA_70B_LAYERS * n / 30)
    out = {}
    for link in ("nvlink-h100", "pcie-no-p2p"):
        row = predict_table("llama-3-70b", get_gpu("h100"), get_link(link), 8, [1], ["ladder"], 128, 128,
                            ladder_layers=[layers])[0]
        out[link] = row["speedup"]
    return {"llama_70b_ladder_layers": layers, **out}


def measure(run_name: str, recipe: str, n: int, model, original, tokenizer, texts, args) -> dict:
    quality = {name: compare(model, original, ids, 512, progress=False) for name, ids in texts.items()}
    return {"recipe": recipe, "ladder_layers": n, "run": run_name,
            "quality": {name: {k: q[k] for k in ("perplexity", "reference_perplexity", "agreement", "kl")}
                        for name, q in quality.items()},
            "answers": chat_answers(model, tokenizer, args.answer_tokens), **predicted_speedups(n)}


def converted_quality(n: int, records: list[dict], original, tokenizer, texts) -> dict:
    """The converted model's distance to the original before training (the same for every recipe at N)."""
    for r in records:
        if r["ladder_layers"] == n and r.get("converted"):
            return r["converted"]
    converted = ModelSpec(model=MODEL, layout="ladder", ladder_layers=n, dtype="float32").load(
        LocalCommunicator(), CPU).model
    return {name: {k: q[k] for k in ("perplexity", "reference_perplexity", "agreement", "kl")}
            for name, q in ((name, compare(converted, original, ids, 512, progress=False))
                            for name, ids in texts.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="distill,ce")
    parser.add_argument("--ladder-layers", default="8,15")
    parser.add_argument("--minutes", type=float, default=28.0, help="each run's training budget")
    parser.add_argument("--steps", type=int, help="instead of --minutes: this many steps")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--hidden-weight", type=float, default=1.0)
    parser.add_argument("--calibrate-tokens", type=int, default=0,
                        help="distill: calibrate the converted modules' inputs on this many tokens first")
    parser.add_argument("--data", default="answers:builtin,shakespeare:train",
                        help="distill, calibrate: the training sources, drawn in equal shares")
    parser.add_argument("--tag", help="a variant of the recipe (say, another --lr): recorded as RECIPE-TAG")
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens per domain")
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--runs-dir", default="runs/distill")
    parser.add_argument("--out", default="results/distillation.jsonl")
    parser.add_argument("--report", action="store_true", help="only rewrite the table and picture")
    parser.add_argument("--references", action="store_true",
                        help="measure the original against copies of itself with bf16 and int8 rounded weights")
    parser.add_argument("--lm-eval", action="store_true",
                        help="score every recorded run (and the original) on lm-eval's ladder_offline tasks")
    parser.add_argument("--lm-eval-recipes", default="original,distill,ce", help="--lm-eval: only these recipes")
    parser.add_argument("--lm-eval-limit", type=int, help="--lm-eval: at most this many documents a task (a check)")
    args = parser.parse_args()
    out = Path(args.out)
    if args.lm_eval:
        score_with_lm_eval(out, args.lm_eval_recipes.split(","), args.lm_eval_limit)
    elif args.references:
        measure_references(args, out)
    elif not args.report:
        run_all(args, out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    write_report(records, out, args)


def run_all(args: argparse.Namespace, out: Path) -> None:
    loaded = load(MODEL)
    original, tokenizer = loaded.model, loaded.tokenizer
    texts = held_out(tokenizer, args.tokens)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []

    def keep(record: dict) -> None:
        records[:] = [r for r in records if (r["recipe"], r["ladder_layers"]) != (record["recipe"], record["ladder_layers"])]
        records.append(record)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(json.dumps({k: v for k, v in record.items() if k != "answers"}), flush=True)

    if not any(r["recipe"] == "original" for r in records):
        record = measure("original", "original", 0, original, original, tokenizer, texts, args)
        record["perplexity"] = {name: perplexity(original, ids, 512, progress=False)["perplexity"]
                                for name, ids in texts.items()}
        keep(record)
    answers, answer_seconds = write_answers(args, tokenizer)
    for recipe in args.recipes.split(","):
        name = f"{recipe}-{args.tag}" if args.tag else recipe
        for n in [int(x) for x in args.ladder_layers.split(",")]:
            run = Path(args.runs_dir) / f"{name}-n{n}"
            planned = run / "planned.json"  # a resumed run keeps the steps it planned
            if not planned.is_file():
                steps, probed = steps_for(recipe, n, args)
                run.mkdir(parents=True, exist_ok=True)
                planned.write_text(json.dumps({"steps": steps, "probed_tokens_per_s": probed}))
            config = recipe_config(recipe, n, json.loads(planned.read_text())["steps"], args, run)
            if recipe in ("distill", "calibrate"):
                run.mkdir(parents=True, exist_ok=True)
                shutil.copy(answers, run / ANSWERS_FILE)
            before = converted_quality(n, records, original, tokenizer, texts)
            result = train(config, resume=(run / "checkpoints").is_dir(), progress=True)
            minutes, tokens, stopped = train_minutes(run)
            record = measure(run.name, name, n, load(str(result.final_dir)).model, original, tokenizer, texts, args)
            record.update(converted=before, train_minutes=minutes, paused_minutes=stopped,
                          train_tokens=tokens, budget_minutes=None if args.steps else args.minutes, answers_minutes=answer_seconds / 60 if recipe != "ce" else None,
                          settings={k: v for k, v in vars(config).items() if k not in ("out_dir", "device")})
            keep(record)


def rounded_bf16(w: torch.Tensor) -> torch.Tensor:
    return w.bfloat16().float()


def rounded_int8(w: torch.Tensor) -> torch.Tensor:
    """Symmetric, a scale per row (`--quantize int8`)."""
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return (w / scale).round().clamp(-128, 127) * scale


# (not int4: the GGUF that SmolLM2 comes from stores its layers in Q4_1, groups of 32 with a scale and a minimum,
# so rounding them as `--quantize int4` does gives them back unchanged)
REFERENCES = {"bf16": rounded_bf16, "int8": rounded_int8}


@torch.no_grad()
def measure_references(args: argparse.Namespace, out: Path) -> None:
    """The original against copies of itself whose layers' linear weights are rounded as a user's
    quantization rounds them (computed in float32, so only the rounding counts), on the same held-out tokens
    and measures as the runs: the agreement and KL that a rounding users already accept costs."""
    loaded = load(MODEL)
    texts = held_out(loaded.tokenizer, args.tokens)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for label, rounded in REFERENCES.items():
        copy = load(MODEL).model
        for _, linear in block_linears(copy):
            linear.weight.copy_(rounded(linear.weight.float()))
        quality = {name: compare(copy, loaded.model, ids, 512, progress=False) for name, ids in texts.items()}
        record = {"recipe": f"{REFERENCE}{label}", "ladder_layers": 0, "run": f"layers' weights rounded to {label}",
                  "quality": {name: {k: q[k] for k in ("perplexity", "reference_perplexity", "agreement", "kl")}
                              for name, q in quality.items()}}
        records = [r for r in records if r["recipe"] != record["recipe"]] + [record]
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(json.dumps(record), flush=True)


LM_EVAL_TASKS = ["ladder_offline"]


def score_with_lm_eval(out: Path, recipes: list[str], limit: int | None) -> None:
    """lm-evaluation-harness's offline tasks (`ladder eval --tasks ladder_offline`) on each record's model,
    stored in its record (`lm_eval`: task -> metric -> value)."""
    import logging

    from lm_eval import simple_evaluate  # (seconds to import: only this part of the experiment needs it)

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record in records:
        if "lm_eval" in record or record["recipe"] not in recipes:
            continue
        name = MODEL if record["recipe"] == "original" else str(sorted(
            (Path("runs/distill") / record["run"] / "checkpoints").glob("step-*"))[-1])
        loaded = load(name)
        results = simple_evaluate(model=ladder_lm(loaded.model, loaded.tokenizer, batch_size=8), tasks=LM_EVAL_TASKS,
                                  task_manager=task_manager(LM_EVAL_TASKS), log_samples=False, limit=limit,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        record["lm_eval"] = {task: {k: v for k, v in metrics.items() if "," in k and "stderr" not in k}
                             for task, metrics in results["results"].items() if task != "ladder_offline"}
        print(record["run"], json.dumps(record["lm_eval"]), flush=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_report(records: list[dict], out: Path, args: argparse.Namespace) -> None:
    """results/distillation.md and .png from the records."""
    original = next(r for r in records if r["recipe"] == "original")
    domains = list(original["quality"])
    references = [r for r in records if r["recipe"].startswith(REFERENCE)]
    runs = sorted((r for r in records if r["recipe"] != "original" and not r["recipe"].startswith(REFERENCE)),
                  key=lambda r: (r["recipe"], r["ladder_layers"]))
    lines = ["# Distillation against cross-entropy, and which N to pick", "",
             f"SmolLM2-135M-Instruct with ladder on its last N of 30 layers; each run trains the converted layers "
             f"for {args.minutes:g} minutes on two CPU cores (the steps that fit, from a probe of the speed). Measured "
             f"against the original model on {args.tokens:,} held-out tokens per domain (windows of 512): "
             "perplexity, greedy next-token agreement, mean KL(original || model) in nats per token. "
             "`.venv/bin/python experiments/distillation.py` (its docstring has the commands).", "",
             "## Quality after adaptation, against the original model", "",
             "| recipe | N | " + " | ".join(f"{d}: perplexity vs original | agreement | KL" for d in domains)
             + " | train tokens | minutes | target |",
             "|---|---|" + "---|---|---|" * len(domains) + "---|---|---|"]
    for r in runs:
        cells = []
        for d in domains:
            q = r["quality"][d]
            cells.append(f"{q['perplexity']:.2f} vs {q['reference_perplexity']:.2f} "
                         f"({q['perplexity'] / q['reference_perplexity'] - 1:+.1%}) | {q['agreement']:.1%} | {q['kl']:.4f}")
        lines.append(f"| {r['recipe']} | {r['ladder_layers']} | " + " | ".join(cells)
                     + f" | {r['train_tokens']:,} | {minutes(r)} | {target_verdict(r, domains)} |")
    lines += ["", "Each run's recipe (`ladder train` settings; trainable: the converted layers):", ""]
    lines += [f"- {r['recipe']} N={r['ladder_layers']}: {recipe_summary(r['settings'])}" for r in runs]
    if references:
        header = " | ".join(f"{d}: perplexity vs original | agreement | KL" for d in domains)
        lines += ["", "How close the targets ask: the original against its own copies with rounded weights (no ladder "
                  "layer), measured the same way (`--references`):", "",
                  f"| copy of the original | {header} |", "|---|" + "---|---|---|" * len(domains)]
        for r in references:
            cells = [f"{q['perplexity']:.2f} vs {q['reference_perplexity']:.2f} "
                     f"({q['perplexity'] / q['reference_perplexity'] - 1:+.1%}) | {q['agreement']:.1%} | {q['kl']:.4f}"
                     for q in (r["quality"][d] for d in domains)]
            lines.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    lines += ["", "Before training (converted, no retraining):", "",
              "| N | " + " | ".join(f"{d}: perplexity (vs original) | agreement" for d in domains) + " |",
              "|---|" + "---|---|" * len(domains)]
    for n in sorted({r["ladder_layers"] for r in runs}):
        r = next(x for x in runs if x["ladder_layers"] == n)
        cells = [f"{r['converted'][d]['perplexity']:.2f} ({r['converted'][d]['perplexity'] / r['converted'][d]['reference_perplexity'] - 1:+.1%}) | "
                 f"{r['converted'][d]['agreement']:.1%}" for d in domains]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    series = {label: {r["ladder_layers"]: r for r in runs if r["recipe"] == recipe}
              for recipe, label in FRONT_SERIES.items()}
    series = {label: by_n for label, by_n in series.items() if by_n}
    if series:
        lines += ["", "## Which N: quality against the speedup on Llama-3-70B (TP 8, H100, batch 1, `ladder predict`)", "",
                  "Each cell: perplexity vs the original on " + " / ".join(domains) + ", and the mean greedy agreement.", "",
                  "| N of 30 | Llama-3-70B layers | speedup NVLink | speedup PCIe no P2P | " + " | ".join(series) + " |",
                  "|---|---|---|---|" + "---|" * len(series)]
        for n in sorted(set(SWEEP) | {n for by_n in series.values() for n in by_n}):
            speed = predicted_speedups(n)
            cells = [front_cell(original if n == 0 else by_n.get(n), domains) for by_n in series.values()]
            lines.append(f"| {n} | {speed['llama_70b_ladder_layers']} | {speed['nvlink-h100']:.3f} | "
                         f"{speed['pcie-no-p2p']:.3f} | " + " | ".join(cells) + " |")
        picture = plot_quality_against_speed(
            {label: [pareto_point(r, domains) for r in [original, *by_n.values()]] for label, by_n in series.items()},
            out.with_suffix(".png"))
        lines += ["", "Same recipe and minutes for every N of a series; the runs that computed the frozen layers' stream "
                  "once for teacher and student (from 102f339) fit more tokens in them.", "",
                  f"![quality against speed]({picture.name})"]
    scored = [r for r in [original, *runs] if "lm_eval" in r]
    if scored:
        columns = [("ladder_shakespeare_lastword", "acc,none", "{:.3f}"), ("ladder_pydoc_lastword", "acc,none", "{:.3f}"),
                   ("ladder_shakespeare_rolling", "word_perplexity,none", "{:.2f}"),
                   ("ladder_pydoc_rolling", "word_perplexity,none", "{:.2f}"),
                   ("ladder_arithmetic", "exact_match,strip", "{:.2f}")]
        lines += ["", "## lm-evaluation-harness, ladder's offline tasks (`ladder eval --tasks ladder_offline`)", "",
                  "| model | " + " | ".join(f"{t.removeprefix('ladder_')} {m.split(',')[0]}" for t, m, _ in columns) + " |",
                  "|---|" + "---|" * len(columns)]
        for r in scored:
            label = "original" if r["recipe"] == "original" else f"{r['recipe']} N={r['ladder_layers']}"
            lines.append(f"| {label} | " + " | ".join(fmt.format(r["lm_eval"][t][m]) for t, m, fmt in columns) + " |")
    lines += ["", "## Greedy chat answers (48 new tokens at most), prompts never trained on", ""]
    columns = [original, *runs]
    lines.append("| prompt | " + " | ".join("original" if r["recipe"] == "original" else f"{r['recipe']} N={r['ladder_layers']}"
                                            for r in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for i, prompt in enumerate(CHAT_EVAL):
        lines.append(f"| {prompt} | " + " | ".join(_cell(r["answers"][i]) for r in columns) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))


def minutes(r: dict) -> str:
    """The optimizer steps' minutes; a run stopped from outside for a while (SIGSTOP: the test suite had
    the cores) has that step counted at the run's median step time, and says so."""
    paused = r.get("paused_minutes")
    return f"{r['train_minutes'] - paused:.1f} (+{paused:.1f} stopped)" if paused else f"{r['train_minutes']:.1f}"


def recipe_summary(settings: dict) -> str:
    data = " + ".join(f"{d} x{w:g}" for d, w in zip(settings["data"], settings.get("data_weights") or [1] * 9))
    loss = (f"KL at T={settings['temperature']:g}" + (f" + residual x{settings['hidden_weight']:g}"
            if settings.get("hidden_weight") else "") if settings.get("teacher") else "cross-entropy")
    if settings.get("calibrate_tokens") and not settings["steps"]:
        return f"calibrated on the first {settings['calibrate_tokens']:,} tokens of {data}, no training step"
    calibrated = f"calibrated on {settings['calibrate_tokens']:,} tokens, then " if settings.get("calibrate_tokens") else ""
    return (f"{calibrated}{loss}; {data}; lr {settings['lr']:g} -> {settings['min_lr']:g}, {settings['steps']} steps of "
            f"{settings['batch_size']} x {settings['seq_len']} tokens, {settings['precision']}")


def target_verdict(r: dict, domains: list[str]) -> str:
    if r["ladder_layers"] not in TARGETS:
        return ""
    within, agree = TARGETS[r["ladder_layers"]]
    worst = max(r["quality"][d]["perplexity"] / r["quality"][d]["reference_perplexity"] - 1 for d in domains)
    lowest = min(r["quality"][d]["agreement"] for d in domains)
    ok = worst <= within and lowest >= agree
    return f"{'met' if ok else 'missed'}: worst {worst:+.1%} (<= {within:.0%}), lowest {lowest:.1%} (>= {agree:.0%})"


def front_cell(r: dict | None, domains: list[str]) -> str:
    if r is None:
        return "not run"
    q = r["quality"]
    ratios = " / ".join(f"{q[d]['perplexity'] / q[d]['reference_perplexity'] - 1:+.1%}" for d in domains)
    return f"{ratios}, {sum(q[d]['agreement'] for d in domains) / len(domains):.1%}"


def pareto_point(r: dict, domains: list[str]) -> dict:
    q = r["quality"]
    loss = math.exp(sum(math.log(q[d]["perplexity"] / q[d]["reference_perplexity"]) for d in domains) / len(domains))
    return {"label": f"N={r['ladder_layers']}", "perplexity_ratio": loss,
            "speedups": {"NVLink": r["nvlink-h100"], "PCIe, no P2P": r["pcie-no-p2p"]}}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    main()
