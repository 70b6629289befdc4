"""A gated MLP's activation from the fused gate/up projection [T, 2I] -> [T, I], one kernel: SwiGLU's
silu(gate) * up, or GeGLU's gelu_tanh(gate) * up (Gemma: GELU's tanh approximation).

Program (t, j) takes columns [j * BLOCK, (j + 1) * BLOCK) of token t; the grid (T, ceil(I / BLOCK)) depends only
on shapes (CUDA-graph capturable). Rounding follows the PyTorch references (`heron.kernels.reference.
silu_and_mul_ref` / `gelu_tanh_and_mul_ref`, which run on CPU): the activation in float32, rounded to the dtype,
then times up in float32, rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.common import pdl_enter, pdl_options, tanh
from heron.kernels.rmsnorm import fix_bf16, round_to

BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,
    FIX_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0)
    tl.store(
        out_ptr + t * stride_o + cols, gated_act(gate, up, out_ptr.dtype.element_ty, GELU_TANH, FIX_BF16), mask=mask
    )


@triton.jit
def gated_act(gate, up, dtype: tl.constexpr, GELU_TANH: tl.constexpr, FIX_BF16: tl.constexpr):
    """act(gate) * up in `dtype`, rounded as the references: the activation in float32, rounded, times up in
    float32, rounded again. (Also the prologue of heron/kernels/lora.py's shrink.)"""
    gate = gate.to(tl.float32)
    if GELU_TANH:  # F.gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        act = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:  # F.silu
        act = gate / (1.0 + tl.exp(-gate))
    act = round_to(act, dtype, FIX_BF16).to(tl.float32)
    return round_to(act * up.to(tl.float32), dtype, FIX_BF16)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] (last dim contiguous) -> silu(x[..., :I]) * x[..., I:] as a new tensor [..., I] (or `out`)."""
    return _act_and_mul(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] (last dim contiguous) -> gelu_tanh(x[..., :I]) * x[..., I:] as a new tensor [..., I] (or `out`)."""
    return _act_and_mul(x, out, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    two_i = x.shape[-1]
    assert two_i % 2 == 0, f"last dim must be even, got {two_i}"
    inter = two_i // 2
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], inter) and out.dtype == x.dtype and out.is_contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2, o2 = (x if x.dim() == 2 else x.reshape(-1, two_i)), out.view(-1, inter)
    rows = x2.shape[0]
    if rows > 0 and inter > 0:
        block = min(BLOCK, triton.next_power_of_2(inter))
        _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2,
            o2,
            inter,
            x2.stride(0),
            o2.stride(0),
            BLOCK=block,
            GELU_TANH=gelu_tanh,
            FIX_BF16=fix_bf16(),
            num_warps=4 if block >= 512 else 1,
            **pdl_options(x.device, rows),
        )
    return out
