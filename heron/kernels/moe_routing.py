"""A MoE router's choice on the GPU: router logits -> each token's k experts and their weights.

Softmax over all E experts in float32, the k largest (ties to the lower index), rescaled to sum to one where
the config renormalises (Mixtral, Qwen3-MoE). `route` is the per-token computation as a Triton function, so
that the decode kernels of heron/kernels/moe_gemv.py route inside their own programs; `topk_softmax` is it as
a launch of its own, for the grouped GEMMs of heron/kernels/fused_moe.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def route(
    logits_ptr,
    t,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Token t's weights [K_PAD] (float32) and experts [K_PAD] (int32), largest first; slots past k hold 0."""
    e = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < num_experts, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(e < num_experts, p / tl.sum(p, axis=0), -1.0)  # padding is never picked
    j = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_i = tl.zeros([K_PAD], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, E_PAD), axis=0)  # the lowest index among equals
        top_w = tl.where(j == i, best, top_w)
        top_i = tl.where(j == i, idx, top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_i


def route_constants(top_k: int, num_experts: int, renormalize: bool) -> dict[str, int | bool]:
    """`route`'s compile-time arguments."""
    return dict(
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize,
    )


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    top_w, top_i = route(logits_ptr, t, num_experts, stride_l, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    j = tl.arange(0, K_PAD)
    tl.store(weights_ptr + t * TOP_K + j, top_w, mask=j < TOP_K)
    tl.store(ids_ptr + t * TOP_K + j, top_i, mask=j < TOP_K)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int32 [T, k]), largest weight first."""
    tokens, num_experts = logits.shape
    assert 1 <= top_k <= num_experts and logits.stride(-1) == 1
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _topk_softmax_kernel[(tokens,)](
            logits,
            weights,
            ids,
            num_experts,
            logits.stride(0),
            **route_constants(top_k, num_experts, renormalize),
            num_warps=1 if num_experts <= 256 else 4,
        )
    return weights, ids
