"""The attention interface: what the model runner gives a backend each step, and what a backend does.

The batch is flat: T new tokens from B sequences, sequence i owning rows
query_start_loc[i]:query_start_loc[i+1]. Sequence i's keys are its first seq_lens[i] tokens, the new
ones last, found in the paged cache through block_tables[i]. Each layer's cache is one tensor
[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], in the model's dtype or float8 e4m3 (`--kv-cache-dtype
fp8`: stored as k / k_scale, clamped to +-448, read back times k_scale); `slot_mapping[t]` = block * block_size +
offset says where token t's K/V go. Backends differ only in how they compute; the scheduler and the
block manager never see them.

What a layer's attention computes besides (a sliding window, soft-capped logits, its own query scale) is the
layer's: it passes its `AttentionParams` with each call, and a backend compiles each distinct set once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_seqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [B + 1] int32, on the device
    seq_lens: torch.Tensor  # [B] int32, on the device
    block_tables: torch.Tensor  # [B, max_blocks] int32, on the device
    slot_mapping: torch.Tensor  # [T] int64, on the device
    max_query_len: int
    max_seq_len: int
    # Host copies of the two length arrays, for backends that plan on the CPU (never read back from
    # the device: that would be a sync).
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # Host copy of the block tables [B, max_blocks] int32 (the runner's pinned buffer), for backends that
    # build their own page tables on the CPU (FlashInfer); only those need it.
    block_tables_cpu: torch.Tensor | None = None
    # A batch padded to a captured CUDA graph's counts (heron/executor/graph_keys.py): run eagerly before the
    # capture, captured, or about to be replayed. Backends that plan into fixed device buffers (FlashInfer) use
    # the graph's; a prefill graph (max_query_len > 1, captured at its token count) may replay any mix of rows.
    cuda_graph: bool = False
    # Cascade attention (attention/cascade.py) for the step's decode rows: None, where it pays; True, always (a
    # graph captured with the cascade kernels, whose grouping is device data: with no group every prefix
    # program exits at once); False, never (a graph captured without them).
    cascade: bool | None = None


@dataclass(frozen=True)
class AttentionParams:
    """One layer's attention, beyond causal softmax(q k^T) v over its sequence's keys (vLLM's names)."""

    scale: float  # on q . k: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    sliding_window: int | None = None  # the query sees its last `sliding_window` keys only, its own included
    logits_soft_cap: float | None = None  # scores s become cap * tanh(s / cap) before the softmax (Gemma 2)
    # An fp8 cache's per-tensor scales (vLLM's k_scale / v_scale): it stores k / k_scale, a read multiplies back.
    # Ignored by a cache in the model's dtype.
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {self.logits_soft_cap}")


class AttentionBackend(ABC):
    name: str
    supports_cuda_graphs = False  # a decode step can be captured: fixed grids, no host-side values
    supports_prefill_cuda_graphs = False  # ... and any step, its grids fixed by the padded counts alone

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.default_params = AttentionParams(scale)  # a call that passes none: full causal attention

    def reserve(  # noqa: B027 (optional hook: most backends need no workspace)
        self,
        max_num_seqs: int,
        device: torch.device,
        *,
        dtype: torch.dtype | None = None,
        block_size: int | None = None,
        max_blocks_per_seq: int | None = None,
        cascade_attn: bool = False,
    ) -> None:
        """Called once before any step: allocate per-step workspaces at their largest size. dtype (of q
        and the cache), block_size and max_blocks_per_seq (the block tables' width) are for backends that
        plan a step before its forward pass has shown them any tensor (FlashInfer); others ignore them.
        `cascade_attn`: plan shared-prefix (cascade) attention for decode rows, where the backend can."""

    def runs_cascade(self, meta: AttentionMetadata) -> bool:
        """Whether the step of `meta` runs the cascade kernels: its graph is the one captured with them
        (`AttentionMetadata.cascade`)."""
        return False

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Called once per step before the forward pass (a backend's per-step planning goes here)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams | None = None
    ) -> torch.Tensor:
        """Attend q [T, H, D] causally over each sequence's cached keys, this step's K/V among them (the
        model's rotary embedding writes them at meta.slot_mapping first), as the calling layer's `params` say
        (None: `default_params`). Returns [T, H, D]."""
