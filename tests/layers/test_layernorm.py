"""RMSNorm and NormLinear on the CPU: the references, with the residual add of a pre-norm block; NormLinear's
projection stays its owner's child."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.kernels.reference import rms_norm_ref
from heron.layers.layernorm import NormLinear, RMSNorm
from heron.layers.linear import ColumnParallelLinear


def test_rms_norm_with_and_without_the_residual():
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    h = x.double()
    want = (norm.weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).float()
    torch.testing.assert_close(norm(x), want)
    out, residual = norm(x, r)
    assert torch.equal(residual, x + r) and torch.equal(out, rms_norm_ref(x + r, norm.weight, 1e-6))


def test_norm_linear_is_the_norm_then_its_projection():
    torch.manual_seed(0)
    proj = ColumnParallelLinear(16, [8, 4], bias=True)
    for p in proj.parameters():
        torch.nn.init.normal_(p)
    pre = NormLinear(16, 1e-5, proj)
    torch.nn.init.normal_(pre.weight)
    norm = RMSNorm(16, 1e-5)
    norm.weight.data.copy_(pre.weight)
    x, r = torch.randn(5, 16), torch.randn(5, 16)
    y, residual = pre(x, r)
    normed, want_residual = norm(x, r)
    assert torch.equal(residual, want_residual) and torch.equal(y, F.linear(normed, proj.weight, proj.bias))
    y, residual = pre(x)  # the first layer: x is the residual
    assert residual is x and torch.equal(y, F.linear(norm(x), proj.weight, proj.bias))


def test_norm_linear_reads_its_projection_without_owning_it():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = ColumnParallelLinear(16, [8], bias=False)
            self.input_layernorm = NormLinear(16, 1e-6, self.proj)

    block = Block()
    assert [n for n, _ in block.named_parameters()] == ["proj.weight", "input_layernorm.weight"]
    assert list(block.state_dict()) == ["proj.weight", "input_layernorm.weight"]
    assert [n for n, _ in block.input_layernorm.named_modules()] == [""]
