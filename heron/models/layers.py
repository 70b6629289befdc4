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


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm in PyTorch (float32 statistics): the CPU path and the reference for the Triton kernel."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up [..., I]: one Triton kernel on CUDA (heron/kernels/activation.py)."""
    if x.is_cuda:
        from heron.kernels.activation import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul in PyTorch: the CPU path and the reference for the Triton kernel."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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


def rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
):
    """Optional per-head RMSNorm, then RoPE, in PyTorch: the CPU path and the reference for the Triton kernel."""
    if q_norm_weight is not None:
        q, k = rms_norm_torch(q, q_norm_weight, eps), rms_norm_torch(k, k_norm_weight, eps)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T'] (a slot of -1 or
    a row t >= T' is skipped), in PyTorch: the CPU path and the reference for the Triton kernel."""
    slots = slot_mapping[: k.shape[0]]
    keep = slots >= 0
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slots[keep], k[: slots.shape[0]][keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots[keep], v[: slots.shape[0]][keep].to(kv_cache.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
