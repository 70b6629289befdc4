"""Paged attention in plain PyTorch: the oracle every faster backend is tested against, and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.executor.attention.backend import AttentionBackend, AttentionMetadata, write_kv


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (written beforehand)."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        q_i = q[starts[i]:starts[i + 1]].transpose(0, 1)  # [H, Q, D]
        num_q = q_i.shape[1]
        blocks = meta.block_tables[i, : -(-seq_len // block_size)]
        k_i, v_i = (kv_cache[j, blocks].flatten(0, 1)[:seq_len].transpose(0, 1) for j in (0, 1))  # [Hkv, L, D]
        # Query t sits at position seq_len - num_q + t and sees keys up to it.
        mask = None
        if num_q > 1:
            pos_q = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= pos_q
        o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, scale=scale,
                                           enable_gqa=k_i.shape[0] != q_i.shape[0])
        out[starts[i]:starts[i + 1]] = o.transpose(0, 1)
    return out


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return paged_attention_ref(q, kv_cache, meta, self.scale)
