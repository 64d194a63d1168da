"""The cost of converting a pretrained model to ladder, zero-shot: SmolLM2-135M-Instruct with ladder on
its last N layers, perplexity on two held-out texts of different domains. Writes
results/conversion_cost.jsonl and prints a Markdown table.

    .venv/bin/python experiments/conversion_cost.py [--tokens 8192] [--window 512]
"""

import argparse
import json
import time
from pathlib import Path

import torch

from ladder.checkpoint.resolve import open_checkpoint
from ladder.comm.base import LocalCommunicator
from ladder.corpora import HELD_OUT_PLAYS, python_docs_text, shakespeare_text
from ladder.evaluate import perplexity
from ladder.model.spec import with_layout
from ladder.model.weights import DictSource, build_model, export_hf_state_dict, load_weights

LADDER_LAYERS = (0, 4, 8, 15, 22, 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens evaluated per text")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default="results/conversion_cost.jsonl")
    parser.add_argument("--table-only", action="store_true", help="rebuild the Markdown table from --out")
    args = parser.parse_args()
    out = Path(args.out)
    if args.table_only:
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        write_table(records, out.with_suffix(".md"))
        return

    checkpoint = open_checkpoint(args.model)
    texts = {f"shakespeare (held-out: {', '.join(HELD_OUT_PLAYS)})": shakespeare_text("heldout"),
             "python docs (pydoc_data)": python_docs_text()}
    ids = {name: checkpoint.tokenizer.encode(text)[: args.tokens] for name, text in texts.items()}
    # Dequantise once; every conversion below uses the very same weights.
    base = build_model(checkpoint.config, LocalCommunicator(), torch.device("cpu"))
    load_weights(base, checkpoint.source)
    weights = DictSource(export_hf_state_dict(base))

    records = []
    for n in LADDER_LAYERS:
        config = with_layout(checkpoint.config, "ladder", n)
        model = build_model(config, LocalCommunicator(), torch.device("cpu"))
        load_weights(model, weights)
        for name, tokens in ids.items():
            start = time.perf_counter()
            result = perplexity(model.eval(), tokens, args.window, progress=False)
            records.append({"model": args.model, "ladder_layers": n, "n_layers": config.n_layers, "text": name,
                            **result, "seconds": time.perf_counter() - start})
            print(f"N={n:>2} {name}: perplexity {result['perplexity']:.2f}", flush=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out)
    write_table(records, out.with_suffix(".md"))


def write_table(records: list[dict], path: Path) -> None:
    """The Markdown table of the README, from the records (never typed by hand)."""
    names = list(dict.fromkeys(r["text"] for r in records))
    layers = sorted({r["ladder_layers"] for r in records})
    ppl = {(r["ladder_layers"], r["text"]): r["perplexity"] for r in records}
    lines = [f"| ladder on the last N of {records[0]['n_layers']} layers | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for n in layers:
        cells = [f"{ppl[(n, name)]:.2f} (x{ppl[(n, name)] / ppl[(0, name)]:.2f})" for name in names]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append(f"\nPerplexity of {records[0]['model']} ({records[0]['n_scored'] + 1} tokens per text; "
                 f"{records[0]['method']}). In brackets: relative to the unconverted model.")
    text = "\n".join(lines) + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(text)


if __name__ == "__main__":
    main()
