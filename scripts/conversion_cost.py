"""The cost of converting a pretrained model to ladder, zero-shot: SmolLM2-135M-Instruct with ladder on
its last N layers, perplexity on two held-out texts of different domains. Writes
results/conversion_cost.jsonl and prints a Markdown table.

    .venv/bin/python scripts/conversion_cost.py [--tokens 8192] [--window 512]
"""

import argparse
import json
import time
from pathlib import Path

import torch

from ladder.checkpoint import open_checkpoint, with_layout
from ladder.corpora import HELD_OUT_PLAYS, python_docs_text, shakespeare_text
from ladder.distributed import LocalCommunicator
from ladder.evaluate import perplexity
from ladder.weights import DictSource, build_model, export_hf_state_dict, load_weights

LADDER_LAYERS = (0, 4, 8, 15, 22, 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens evaluated per text")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default="results/conversion_cost.jsonl")
    args = parser.parse_args()

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

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out)

    names = list(ids)
    base_ppl = {name: next(r["perplexity"] for r in records if r["ladder_layers"] == 0 and r["text"] == name)
                for name in names}
    print(f"\n{records[0]['method']}; {args.tokens} tokens per text\n")
    print("| ladder on last N of 30 layers | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for n in LADDER_LAYERS:
        cells = []
        for name in names:
            ppl = next(r["perplexity"] for r in records if r["ladder_layers"] == n and r["text"] == name)
            cells.append(f"{ppl:.2f} (x{ppl / base_ppl[name]:.2f})")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
