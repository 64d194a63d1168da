"""Whether a compiled step could reach the GEMM templates' int8 speed with its weights as inputs (so that
torch's caches hold it whole): SmolLM2's int8 linear shapes at batch 1, bf16 activations, on torch's int8
kernel (`_weight_int8pack_mm`, what inductor's pattern gives an unfrozen step) against the product written
as a reduction that inductor compiles itself (dequantize, multiply, sum: one pass over the int8 weight).
Milliseconds a decode step spends in each shape (median of a few calls x the layers that have it).

    PYTHONPATH=src .venv/bin/python experiments/investigations/int8_gemv.py
"""

import torch

from timing import median_ms  # (this folder: first on sys.path when a script runs)

# (out features, in features): count in SmolLM2-135M's decode step (30 layers and the head)
SHAPES = {"wqkv": ((960, 576), 30), "wo": ((576, 576), 30), "w13": ((3072, 576), 30), "w2": ((576, 1536), 30),
          "head": ((49152, 576), 1)}


def as_reduction(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return ((x.float()[:, None, :] * weight.float()).sum(-1) * scales.float()).to(x.dtype)


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    reduction = torch.compile(as_reduction, dynamic=False, fullgraph=True)
    totals = {"int8 kernel": 0.0, "compiled reduction": 0.0}
    print("| linear | out x in | layers | int8 kernel ms | compiled reduction ms | max difference |")
    print("|---|---|---|---|---|---|")
    for name, ((n, k), count) in SHAPES.items():
        x = torch.randn(1, k, dtype=torch.bfloat16)
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales = torch.rand(n, dtype=torch.bfloat16) / 64
        kernel_ms = median_ms(lambda: torch._weight_int8pack_mm(x, weight, scales), 50)
        reduction_ms = median_ms(lambda: reduction(x, weight, scales), 50)
        difference = (torch._weight_int8pack_mm(x, weight, scales).float() - reduction(x, weight, scales).float()).abs().max()
        totals["int8 kernel"] += kernel_ms * count
        totals["compiled reduction"] += reduction_ms * count
        print(f"| {name} | {n} x {k} | {count} | {kernel_ms:.3f} | {reduction_ms:.3f} | {difference:.3g} |")
    print(f"| a decode step's linears | | | {totals['int8 kernel']:.1f} | {totals['compiled reduction']:.1f} | |")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
