"""Rotary position embedding in the rotate-half layout of Hugging Face checkpoints, optionally after an RMSNorm
over each head of q and k (Qwen3), writing this step's K and V into the paged cache: one Triton kernel on CUDA
(heron/kernels/rope.py), so that the cache write is no kernel of its own."""

from __future__ import annotations

import math

import torch

from heron.kernels.reference import apply_rope_and_cache_ref, apply_rope_ref
from heron.layers.device_ops import DeviceOps
from heron.layers.layernorm import RMSNorm


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, long_context: bool = False) -> torch.Tensor:
    """RoPE's frequencies; `long_context` picks LongRoPE's long factors (else its short ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling["rope_type"] == "linear":
        return (inv_freq / scaling["factor"]).float()
    if scaling["rope_type"] == "longrope":
        factors = torch.tensor(scaling["long_factor" if long_context else "short_factor"], dtype=torch.float64)
        return (inv_freq / factors).float()
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    out = torch.where((wavelen <= old_len / low) & (wavelen >= old_len / high), blended, out)
    return out.float()


class RotaryEmbedding(DeviceOps):
    """The cos/sin table of one model (shared by its layers) and the rotation. A per-head q/k norm is passed in
    by the attention that owns it, and runs inside the same kernel on CUDA."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        """`max_positions`: the table's rows, the longest context it serves (LongRoPE picks its factors by it)."""
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False)
        if self.cos_sin.device.type != "meta":
            self.materialize()
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.cos_sin.is_cuda:
            head_dim = self.args[0]
            if head_dim & (head_dim - 1):  # (the kernel's tiles are powers of two; it would fail an assert)
                raise ValueError(
                    f"Heron's CUDA kernels need a power-of-two head_dim; this model's is {head_dim} (it runs on "
                    "the CPU: --device cpu)."
                )
            from heron.kernels.rope import apply_rope, apply_rope_and_cache

            self._rope, self._rope_and_cache = apply_rope, apply_rope_and_cache
        else:
            self._rope, self._rope_and_cache = apply_rope_ref, apply_rope_and_cache_ref

    def materialize(self) -> None:
        """(Re)compute the cos/sin table in place; the model runner calls it after building on `meta`."""
        head_dim, max_positions, theta, scaling = self.args
        # LongRoPE: the long factors where the served context passes the original one, for every position (a key
        # in the cache is never rotated again; transformers switches per forward pass, llama.cpp as here)
        longrope = scaling is not None and scaling["rope_type"] == "longrope"
        long = longrope and max_positions > scaling["original_max_position_embeddings"]
        inv_freq = rope_inv_freq(head_dim, theta, scaling, long)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).to(self.cos_sin.device)
        mscale = 1.0 if scaling is None else scaling.get("attention_factor", 1.0)  # LongRoPE's
        self.cos_sin.copy_(torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> rotated copies; with q_norm / k_norm each head is RMS-normalised first."""
        return self._rope(q, k, positions, self.cos_sin, *_norm_args(q_norm, k_norm))

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
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """`forward`, with the rotated k and v written into the paged KV cache at slot_mapping (-1: skip a padded
        row) instead of returned (a float8 cache: divided by `kv_scales`, (k_scale, v_scale)); returns the rotated
        q."""
        norm = _norm_args(q_norm, k_norm)
        k_scale, v_scale = kv_scales
        return self._rope_and_cache(
            q, k, v, positions, self.cos_sin, kv_cache, slot_mapping, *norm, k_scale=k_scale, v_scale=v_scale
        )


def _norm_args(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple:
    return () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
