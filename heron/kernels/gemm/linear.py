"""The matmul door's entry points on CUDA; the layers bind them, with the `MatmulPlans` registry they were built
with, when they are built on (or moved to) a GPU, and F.linear with the PyTorch references elsewhere.

At decode sizes (at most 16 rows) a projection runs in the Triton GEMV, which reads the weight at close to full
bandwidth where cuBLAS's small-M kernels do not, and takes the op before it into its prologue (a decoder layer's
RMSNorm with the residual add, SwiGLU's activation): one launch instead of two. Past 16 rows, or where the
operands do not fit the GEMV (`use_gemv`), the BLAS kernel tuned for the weight runs (blas.py), after the op
before it as a kernel of its own.

A float8 weight comes with `weight_scale` (float32 [N, 1], fp8.py): the GEMV reads it as it reads a 16-bit one
(W8A16, each row's sums scaled once), so a decode step keeps its fused prologues and pays no activation
quantization; past 16 rows the W8A8 GEMM (`fp8_linear`) runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from heron.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from heron.kernels.gemm.blas import blas_linear
from heron.kernels.gemm.fp8 import fp8_linear
from heron.kernels.gemm.plans import MatmulPlans
from heron.kernels.gemv import gemv, gemv_norm_gemv, gemv_rms_norm, gemv_silu_mul, use_gemv
from heron.kernels.rmsnorm import fused_add_rms_norm, rms_norm

if TYPE_CHECKING:
    from heron.kernels.lora import LoRAWeights


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plans: MatmulPlans | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRAWeights | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias): the GEMV for a decode batch, else the BLAS kernel `plans` holds for the weight
    (or, for a float8 weight with `weight_scale`, the FP8 GEMM); plus the delta of the `lora` adapters over x
    (its shrink first; its expand in the GEMV's epilogue at batch 1, else its kernel after)."""
    if use_gemv(x, weight, bias, weight_scale):
        return gemv(x, weight, bias, weight_scale=weight_scale, lora=lora.shrink(x) if lora is not None else None)
    if weight_scale is not None:
        y = fp8_linear(x, weight, bias, weight_scale=weight_scale)
    else:
        y = blas_linear(x, weight, bias, plans)
    return y if lora is None else lora.finish(y, lora.shrink(x))


def silu_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plans: MatmulPlans | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRAWeights | None = None,
) -> torch.Tensor:
    """linear(silu(gate) * up) of a fused gate/up projection's output [..., 2I]: one GEMV kernel at decode sizes.
    `lora`: as `linear`'s, over silu(gate) * up (made inside its shrink at decode sizes); and the delta the gate/up
    projection left for this activation (`LoRAWeights.take`), added to gate/up inside it."""
    if use_gemv(gate_up[..., : weight.shape[1]], weight, bias, weight_scale):
        _add_gate_up_delta(gate_up, lora)
        delta = lora.shrink(gate_up, act="silu") if lora is not None else None
        return gemv_silu_mul(gate_up, weight, bias, weight_scale=weight_scale, lora=delta)
    return linear(_act_and_mul(gate_up, lora, gelu_tanh=False), weight, bias, plans, weight_scale, lora)


def gelu_tanh_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plans: MatmulPlans | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRAWeights | None = None,
) -> torch.Tensor:
    """linear(gelu_tanh(gate) * up) (GeGLU's down projection): the activation kernel, then the projection. Never
    the GEMV's fused prologue, which computes SiLU. `lora`: as `silu_mul_linear`'s."""
    return linear(_act_and_mul(gate_up, lora, gelu_tanh=True), weight, bias, plans, weight_scale, lora)


def _act_and_mul(gate_up: torch.Tensor, lora: LoRAWeights | None, gelu_tanh: bool) -> torch.Tensor:
    """The activation kernel, or, where the gate/up projection left its LoRA delta for it, the kernel that adds the
    delta to gate/up as it reads them (heron/kernels/lora.py)."""
    delta = lora.take() if lora is not None else None
    if delta is not None:
        return delta.act_and_mul(gate_up.reshape(-1, gate_up.shape[-1]), gelu_tanh).view(*gate_up.shape[:-1], -1)
    return gelu_tanh_and_mul(gate_up) if gelu_tanh else silu_and_mul(gate_up)


def _add_gate_up_delta(gate_up: torch.Tensor, lora: LoRAWeights | None) -> None:
    """Where the GEMV runs the activation in its prologue, a delta the gate/up projection left (it took the BLAS
    path: both doors see the same rows, so only where the GEMV refused gate/up's operands) is added first."""
    delta = lora.take() if lora is not None else None
    if delta is not None:
        delta.add_to_(gate_up.view(-1, gate_up.shape[-1]))


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plans: MatmulPlans | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRAWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's entry: (linear(rmsnorm(x + residual)), x + residual); without a residual (the first
    layer) x itself is the residual. One GEMV kernel at decode sizes. `lora`: as `linear`'s, over the normed
    rows (made from x and residual inside its shrink at decode sizes)."""
    fits = use_gemv(x, weight, bias, weight_scale) and norm_weight.dtype == x.dtype
    if fits and (residual is None or residual.stride(-1) == 1):
        delta = lora.shrink(x, norm=(norm_weight, eps), residual=residual) if lora is not None else None
        return gemv_rms_norm(x, residual, norm_weight, eps, weight, bias, weight_scale=weight_scale, lora=delta)
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias, plans, weight_scale, lora), residual


def linear_norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight2: torch.Tensor,
    plans: MatmulPlans | None = None,
    plans2: MatmulPlans | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A projection, the residual add and RMSNorm after it, and a second projection of the normed rows: returns
    (linear(normed, weight2), normed, h) for h = linear(x, weight) + residual, normed = norm_weight * rmsnorm(h)
    (a MoE layer's attention output projection, post-attention norm and router). One GEMV kernel at one row of
    16-bit operands (`gemv_norm_gemv`: the norm and the router as tail tiles of the first product); else the
    first product, the add-norm kernel and the second product."""
    one = x.dim() == 2 and x.shape[0] == 1 and weight_scale is None and use_gemv(x, weight)
    if one and residual.is_contiguous() and weight2.dtype == norm_weight.dtype == x.dtype and weight2.is_contiguous():
        return gemv_norm_gemv(x, weight, residual, norm_weight, eps, weight2)
    normed, h = fused_add_rms_norm(linear(x, weight, None, plans, weight_scale), residual, norm_weight, eps)
    return linear(normed, weight2, None, plans2), normed, h
