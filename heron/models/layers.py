"""The building blocks every supported family shares. On CUDA tensors RMSNorm (with the residual add),
the per-head q/k norm with RoPE, and silu_and_mul each run as one Triton kernel (heron/kernels/rmsnorm.py,
rope.py, activation.py); elsewhere the PyTorch code here runs, which is also the kernels' reference.
`linear` is every projection's matmul: a Triton GEMV at decode sizes on CUDA (heron/kernels/gemv.py), which
also takes in the op before it (`norm_linear`, `swiglu_linear`), so a decode step launches fewer kernels."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels.reference import apply_rope_ref as rope_torch
from heron.kernels.reference import rms_norm_ref as rms_norm_torch
from heron.kernels.reference import silu_and_mul_ref as silu_and_mul_torch
from heron.kernels.reference import write_kv_ref as write_kv_torch
from heron.models import blas


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CUDA: with at most 16 rows (a decode batch) the Triton GEMV, which reads the weight
    at close to full bandwidth (cuBLAS's small-M kernels do not), else the BLAS kernel that ran this weight
    fastest at this many rows (heron/models/blas.py): the one place these choices are made."""
    if x.is_cuda:
        from heron.kernels.gemv import gemv, use_gemv

        if use_gemv(x, weight, bias):
            return gemv(x, weight, bias)
        return blas.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def norm_linear(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's entry: (linear(norm(x + residual)), x + residual); without a residual (the first
    layer) x itself is the residual. At decode sizes on CUDA, one GEMV kernel does both."""
    if x.is_cuda:
        from heron.kernels.gemv import gemv_rms_norm, use_gemv

        fits = use_gemv(x, weight, bias) and norm.weight.dtype == x.dtype
        if fits and (residual is None or residual.stride(-1) == 1):
            return gemv_rms_norm(x, residual, norm.weight, norm.eps, weight, bias)
    normed, residual = (norm(x), x) if residual is None else norm(x, residual)
    return linear(normed, weight, bias), residual


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up) of a fused gate/up projection's output [..., 2I]: one GEMV kernel at decode
    sizes on CUDA."""
    if gate_up.is_cuda:
        from heron.kernels.gemv import gemv_silu_mul, use_gemv

        if use_gemv(gate_up[..., : weight.shape[1]], weight, bias):
            return gemv_silu_mul(gate_up, weight, bias)
    return linear(silu_and_mul(gate_up), weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: adds it first and returns (normed, new residual), the pre-norm pattern.
        One Triton kernel on CUDA (heron/kernels/rmsnorm.py), the PyTorch code below elsewhere."""
        if x.is_cuda:
            from heron.kernels.rmsnorm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up [..., I]: one Triton kernel on CUDA (heron/kernels/activation.py)."""
    if x.is_cuda:
        from heron.kernels.activation import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling["rope_type"] == "linear":
        return (inv_freq / scaling["factor"]).float()
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    out = torch.where((wavelen <= old_len / low) & (wavelen >= old_len / high), blended, out)
    return out.float()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout of Hugging Face checkpoints."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False)
        if self.cos_sin.device.type != "meta":
            self.materialize()

    def materialize(self) -> None:
        """(Re)compute the cos/sin table in place; the model runner calls it after building on `meta`."""
        head_dim, max_positions, theta, scaling = self.args
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).to(self.cos_sin.device)
        self.cos_sin.copy_(torch.cat([freqs.cos(), freqs.sin()], dim=-1))

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ):
        """q [T, H, D], k [T, Hkv, D] -> rotated copies; with q_norm / k_norm (Qwen3) each head is
        RMS-normalised first. One Triton kernel on CUDA (heron/kernels/rope.py), PyTorch elsewhere."""
        norm = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        if q.is_cuda:
            from heron.kernels.rope import apply_rope

            return apply_rope(q, k, positions, self.cos_sin, *norm)
        return rope_torch(q, k, positions, self.cos_sin, *norm)

    def rotate_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """`forward`, with the rotated k and v written into the paged KV cache at slot_mapping (-1: skip a
        padded row) instead of returned; returns the rotated q. One Triton kernel on CUDA."""
        norm = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        if q.is_cuda:
            from heron.kernels.rope import apply_rope_and_cache

            return apply_rope_and_cache(q, k, v, positions, self.cos_sin, kv_cache, slot_mapping, *norm)
        q, k = rope_torch(q, k, positions, self.cos_sin, *norm)
        write_kv_torch(k, v, kv_cache, slot_mapping)
        return q
