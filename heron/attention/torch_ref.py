"""Paged attention in plain PyTorch: the per-sequence oracle every faster backend is tested against, and
the batched form of the same function that the CPU runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.attention.backend import AttentionBackend, AttentionMetadata, AttentionParams
from heron.kernels.reference import dequantize_kv


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (written beforehand); with
    `sliding_window` W a query sees its last W keys only, with `soft_cap` c scores s become c * tanh(s / c). A
    float8 cache's K and V are read back in q's dtype, times k_scale / v_scale."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        q_i = q[starts[i] : starts[i + 1]].transpose(0, 1)  # [H, Q, D]
        num_q = q_i.shape[1]
        blocks = meta.block_tables[i, : -(-seq_len // block_size)]
        k_i, v_i = (
            dequantize_kv(kv_cache[j, blocks].flatten(0, 1)[:seq_len], q.dtype, sc).transpose(0, 1)  # [Hkv, L, D]
            for j, sc in ((0, k_scale), (1, v_scale))
        )
        group = q_i.shape[0] // k_i.shape[0]
        k_i, v_i = k_i.repeat_interleave(group, 0), v_i.repeat_interleave(group, 0)
        # Query t sits at position seq_len - num_q + t.
        pos_q = torch.arange(seq_len - num_q, seq_len, device=q.device)
        mask = visible_keys(pos_q, seq_len, sliding_window)
        out[starts[i] : starts[i + 1]] = attend(q_i, k_i, v_i, mask, scale, soft_cap).transpose(0, 1)
    return out


def visible_keys(pos_q: torch.Tensor, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """[Q, num_keys] bool: which keys the queries at positions pos_q see (causal, within the window)."""
    n = torch.arange(num_keys, device=pos_q.device)[None, :]
    mask = n <= pos_q[:, None]
    return mask if sliding_window is None else mask & (n > pos_q[:, None] - sliding_window)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, soft_cap: float | None
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the keys `mask` lets each query see (q, k, v with equal head counts). SDPA
    without a soft cap; with one, the scores are capped in float32 (SDPA has no hook for it), as transformers'
    eager attention computes them."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = (q @ k.transpose(-1, -2)).float() * scale
    s = torch.tanh(s / soft_cap) * soft_cap
    p = s.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
    return p @ v


def paged_attention_batched(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    scratch: list[torch.Tensor] | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The oracle's function in fewer calls: every single-query (decode) row in one padded call, each
    longer chunk in a call of its own. The query heads that share a KV head are folded into the query
    length, so SDPA sees equal head counts and takes its fused kernel instead of the GQA fallback.
    `scratch` (two 1-D tensors, grown as needed) takes the gathered K and V: on the CPU a fresh allocation
    per layer costs more in page faults than the copy itself. A float8 cache's are then dequantized (new tensors
    in q's dtype)."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    group = q.shape[1] // num_kv_heads
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    q_lens = starts[1:] - starts[:-1]
    out = torch.empty_like(q)
    decode = (q_lens == 1).nonzero().flatten()
    if len(decode):
        rows = starts[:-1][decode].to(q.device)
        k, v = _gather(kv_cache, meta.block_tables[decode.to(q.device)], int(lens[decode].max()), scratch)
        k, v = dequantize_kv(k, q.dtype, k_scale), dequantize_kv(v, q.dtype, v_scale)
        mask = visible_keys(lens[decode].to(q.device) - 1, k.shape[2], sliding_window)  # each row at its last key
        o = attend(
            q[rows].view(len(decode), num_kv_heads, group, head_dim), k, v, mask[:, None, None, :], scale, soft_cap
        )
        out[rows] = o.flatten(1, 2)
    for i in (q_lens > 1).nonzero().flatten().tolist():
        a, b, seq_len = int(starts[i]), int(starts[i + 1]), int(lens[i])
        num_q = b - a
        k, v = _gather(kv_cache, meta.block_tables[i : i + 1], seq_len, scratch)
        k, v = dequantize_kv(k, q.dtype, k_scale), dequantize_kv(v, q.dtype, v_scale)
        q_i = (
            q[a:b]
            .view(num_q, num_kv_heads, group, head_dim)
            .permute(1, 2, 0, 3)
            .reshape(1, num_kv_heads, group * num_q, head_dim)
        )
        pos_q = torch.arange(seq_len - num_q, seq_len, device=q.device)
        mask = visible_keys(pos_q, seq_len, sliding_window).repeat(group, 1)
        o = attend(q_i, k, v, mask, scale, soft_cap)
        out[a:b] = o.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3).flatten(1, 2)
    return out


def _gather(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int, scratch: list[torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `length` positions of each block-table row: [B, Hkv, length, D] each."""
    blocks = block_tables[:, : -(-length // kv_cache.shape[2])]
    rows, per_block = blocks.shape[0], kv_cache.shape[2:]
    out = []
    for j in (0, 1):
        numel = blocks.numel() * per_block.numel()
        if scratch is None:
            kv = kv_cache[j][blocks.flatten()]
        else:
            if scratch[j].numel() < numel:
                scratch[j] = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
            kv = torch.index_select(kv_cache[j], 0, blocks.flatten(), out=scratch[j][:numel].view(-1, *per_block))
        out.append(kv.view(rows, -1, *per_block[1:])[:, :length].transpose(1, 2))
    return out[0], out[1]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._scratch = [torch.empty(0), torch.empty(0)]  # gathered K, V; shared by all layers, one at a time

    def forward(self, q, kv_cache, meta: AttentionMetadata, params: AttentionParams | None = None):
        p = params or self.default_params
        return paged_attention_batched(
            q,
            kv_cache,
            meta,
            p.scale,
            self._scratch,
            sliding_window=p.sliding_window,
            soft_cap=p.logits_soft_cap,
            k_scale=p.k_scale,
            v_scale=p.v_scale,
        )
