"""A compiled CPU decode step's attention: ATen's flash kernel (upcast to float32, as `ladder.model.attention.attend`)
against `ladder.model.attention.decode_attention` (products and sums that inductor compiles), at SmolLM2's shape (9
query heads, 3 KV heads of 64) over S cached positions, half of them masked, for B rows. Thirty layers in one
graph, a 576 x 576 linear between attentions as a model has; "no attention" is that graph without them. Best
of 5 runs of 100 calls (of 10 past 4096 positions).

    PYTHONPATH=src .venv/bin/python experiments/investigations/decode_attention.py [--positions 256,1024,2048,4096]
        [--batch 1]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from ladder.model.attention import decode_attention

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
DIM = HEADS * HEAD_DIM


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)


def no_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return q


def graph_ms(attention, positions: int, batch: int) -> float:
    weights = [torch.randn(DIM, DIM, dtype=torch.bfloat16) * DIM ** -0.5 for _ in range(LAYERS)]
    keys, values = (torch.randn(LAYERS, batch, KV_HEADS, positions, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(batch, 1, 1, positions, dtype=torch.bool)
    mask[..., : positions // 2] = True

    def layers(x: torch.Tensor) -> torch.Tensor:
        for i in range(LAYERS):
            q = F.linear(x, weights[i]).view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
            x = attention(q, keys[i], values[i], mask).to(x.dtype).transpose(1, 2).reshape(batch, DIM)
        return x

    compiled = torch.compile(layers, fullgraph=True)
    x = torch.randn(batch, DIM, dtype=torch.bfloat16)
    calls = 100 if positions <= 4096 else 10
    for _ in range(calls // 5):
        compiled(x)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            compiled(x)
        runs.append((time.perf_counter() - start) / calls)
    return min(runs) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", default="256,1024,2048,4096")
    parser.add_argument("--batch", type=int, default=1, help="rows, each over its own cache")
    args = parser.parse_args()
    print(f"batch {args.batch}\n| cached positions | no attention (ms) | ATen flash (ms) | decode_attention (ms) |\n"
          "|---|---|---|---|")
    for positions in map(int, args.positions.split(",")):
        times = [graph_ms(attention, positions, args.batch) for attention in (no_attention, flash, decode_attention)]
        print(f"| {positions} | " + " | ".join(f"{ms:.2f}" for ms in times) + " |", flush=True)


if __name__ == "__main__":
    main()
