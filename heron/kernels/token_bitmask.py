"""Structured outputs' token mask on the logits, in place: -inf on each row's tokens whose bit is 0 in an int32
bitmask [R, ceil(V / 32)] (bit v % 32 of word v // 32 allows token v: xgrammar's layout, which its matchers fill).

One program per (row, BLOCK tokens). The row count lives only in the grid, so every batch size runs one compiled
kernel, warmed at start-up (ModelRunner.compile_kernels). xgrammar's own Triton kernel takes the row count as an
argument, which Triton specializes (1, multiples of 16, the rest): each kind compiled inside the first step
that met it, mid-run, a step of ~0.35 s on an H100 (`profile-structured`'s batch-1 steps)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _mask_kernel(logits_ptr, bitmask_ptr, vocab, logits_stride, bitmask_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    real = tokens < vocab
    words = tl.load(bitmask_ptr + row * bitmask_stride + tokens // 32, mask=real, other=-1)
    banned = ((words >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=real & banned)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (rows contiguous) -inf where bitmask [>= R, W] int32 (on logits' device) bans the token;
    tokens past 32 * W are left as they are. Returns logits."""
    assert bitmask.dtype == torch.int32 and logits.stride(1) == 1 and bitmask.stride(1) == 1
    assert bitmask.shape[0] >= logits.shape[0], "a mask row for every logits row"
    rows, vocab = logits.shape[0], min(logits.shape[1], 32 * bitmask.shape[1])
    if rows:
        grid = (rows, triton.cdiv(vocab, BLOCK))
        _mask_kernel[grid](logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK, num_warps=8)
    return logits
