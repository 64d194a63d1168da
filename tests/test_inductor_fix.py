"""torch inductor's CPU fusion and a custom op that writes its result into a tensor it is given (as vLLM's
CPU linear layers do): compiled, a ladder schedule read a module's output before the op had written it.
`ladder.cpu.inductor_fix` mends it; this is the reproduction, without vLLM."""

import pytest
import torch
from torch import nn
from torch._inductor.scheduler import SchedulerNode

from ladder.cpu.inductor_fix import keep_mutation_renames


@torch.library.custom_op("ladder_test::mm_into", mutates_args=("out",))
def mm_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    torch.mm(x, weight.t(), out=out)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's `ops.onednn_mm`: an empty output, written by the op."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    mm_into(out, x, weight)
    return out


class LadderOfLinears(nn.Module):
    """Module j reads the residual stream without module j-1's output (ladder's schedule), each module a
    norm and a linear layer."""

    def __init__(self, n_modules: int, dim: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(dim, dim) / dim**0.5) for _ in range(n_modules))
        self.gains = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(dim)) for _ in range(n_modules))

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        pending: list[torch.Tensor] = []
        for weight, gain in zip(self.weights, self.gains):
            while len(pending) > 1:
                r = r + pending.pop(0)
            normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5) * gain
            pending.append(linear(normed, weight))
        for y in pending:
            r = r + y
        return r


def compiled_error(model: nn.Module, x: torch.Tensor) -> float:
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        expected = model(x)
        got = torch.compile(model, backend="inductor", dynamic=True)(x)
    return (got - expected).abs().max().item()


def test_compiled_ladder_reads_each_output_after_the_op_writes_it(monkeypatch):
    # torch's own method, even where a compiled step earlier in this process installed the fix
    installed = SchedulerNode.recompute_size_and_body
    monkeypatch.setattr(SchedulerNode, "recompute_size_and_body", getattr(installed, "__wrapped__", installed))
    torch.manual_seed(0)
    model, x = LadderOfLinears(n_modules=8, dim=64), torch.randn(7, 64)
    unfixed = compiled_error(model, x)
    keep_mutation_renames()
    keep_mutation_renames()  # idempotent
    # fp32, the same operations in another order: a few ulps of a value near 1
    assert compiled_error(model, x) < 1e-4
    if unfixed < 1e-4:
        pytest.fail(f"torch {torch.__version__} compiles this correctly without ladder.cpu.inductor_fix: "
                    "drop the fix (and this test's reproduction)")
