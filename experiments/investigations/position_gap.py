"""Where in the 512-token evaluation window a converted model is far from the original: KL, greedy agreement
and the perplexity ratio by position bucket, per held-out domain.

Distillation trains on sequences of `seq_len` (256 in experiments/distillation.py) and the held-out
comparison scores windows of 512: if the positions past the training length are the worse half, training
at 512 is the fix; if the halves are level, the gap is not about length.

    .venv/bin/python experiments/investigations/position_gap.py --model runs/distill/distill-n8/checkpoints/step-000080
"""

import argparse
import math

import torch
import torch.nn.functional as F

from ladder.comm.base import LocalCommunicator
from ladder.corpora import python_docs_text, shakespeare_text
from ladder.evaluate import windows
from ladder.model.spec import ModelSpec

ORIGINAL = "smollm2-135m-instruct"
DOMAINS = {"shakespeare held-out": lambda: shakespeare_text("heldout"), "python docs": python_docs_text}


def load(name: str):
    return ModelSpec(model=name, dtype="float32").load(LocalCommunicator(), torch.device("cpu"))


@torch.inference_mode()
def by_position(model, original, ids: list[int], window: int, bucket: int) -> list[dict]:
    """Per bucket of `bucket` positions in the window: scored tokens, agreement, mean KL, perplexity ratio."""
    n_buckets = window // bucket
    sums = torch.zeros(4, n_buckets, dtype=torch.float64)  # count, agreements, KL, NLL minus the original's
    tokens = torch.tensor(ids)
    for begin, end, first in windows(len(ids), window, window - 1):
        scored = slice(first - 1 - begin, end - 1 - begin)  # the predicting positions in the window
        chunk = tokens[None, begin:end]
        logp = F.log_softmax(model(chunk).float()[0, scored], dim=-1)
        ref_logp = F.log_softmax(original(chunk).float()[0, scored], dim=-1)
        targets = tokens[first:end, None]
        per_position = torch.stack([torch.ones(len(targets)), (logp.argmax(-1) == ref_logp.argmax(-1)).float(),
                                    (ref_logp.exp() * (ref_logp - logp)).sum(-1),
                                    (ref_logp.gather(-1, targets) - logp.gather(-1, targets))[:, 0]]).double()
        buckets = (torch.arange(scored.start, scored.stop) // bucket).clamp(max=n_buckets - 1)
        sums.index_add_(1, buckets, per_position)
    count, agree, kl, nll_gap = sums
    return [{"positions": f"{i * bucket}-{(i + 1) * bucket - 1}", "tokens": int(count[i]),
             "agreement": float(agree[i] / count[i]), "kl": float(kl[i] / count[i]),
             "perplexity_ratio": math.exp(nll_gap[i] / count[i])} for i in range(n_buckets)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the converted (distilled) checkpoint")
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens per domain")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--bucket", type=int, default=128)
    args = parser.parse_args()
    original = load(ORIGINAL)
    model = load(args.model).model
    print("| domain | positions | tokens | perplexity vs original | agreement | KL |\n|---|---|---|---|---|---|")
    for name, text in DOMAINS.items():
        ids = original.tokenizer.encode(text())[:args.tokens]
        for row in by_position(model, original.model, ids, args.window, args.bucket):
            print(f"| {name} | {row['positions']} | {row['tokens']} | {row['perplexity_ratio'] - 1:+.1%} | "
                  f"{row['agreement']:.1%} | {row['kl']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
