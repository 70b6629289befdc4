"""The routed experts of a decode step of a few tokens, as two GEMV launches with the routing inside them.

At batch 1 a MoE layer's expert work is k GEMV pairs over k different experts' weights (Qwen3-30B-A3B: 8 of
128, 75 MB a layer), which the grouped GEMM path of heron/kernels/fused_moe.py runs in four launches (top-k,
two GEMMs with tensor-core tiles of 16 rows for one, the combine). Here, for the steps of
heron/kernels/fused_moe.py's `GEMV_MAX_TOKENS` (each (token, expert) entry on its own, so an expert two tokens
share is read twice), in two:

1. `_up_kernel`, program (n, entry): routes the entry's token itself (softmax over its E router logits and
   heron/kernels/moe_routing.py's `route`: a few reductions over E values, repeated by every program instead of a
   launch of their own), then streams rows [n * BLOCK_N, (n + 1) * BLOCK_N) of its expert's gate and up
   matrices on the CUDA cores (FMA, float32 sums) and stores silu(gate) * up [T * k, I].
2. `_down_kernel`, program (n, token): routes the token again and streams the [BLOCK_N, I] tiles of its k
   experts' down matrices in one pipelined loop, so the k rows are weighted and summed in the program: no
   [T * k, H] intermediate and no combine launch.

Both grids depend on the shapes only (CUDA-graph replay under any routing). Rounding follows the PyTorch
reference (`heron.kernels.reference.fused_experts_ref`): gate and up rounded to the activation dtype, silu
rounded, times up rounded; each down sum times its float32 weight rounded once; the k rows summed in float32
and rounded once.

On the H200 at batch 1 (Qwen3-30B-A3B's experts): 28.8 us a layer against 30.3 for the grouped path with its
routing; the weights stream at ~2.6 TB/s, so the launches were not the grouped path's main cost.

Configs: `GemvMoeConfig` by a rule from the shapes (`default_config`) or per call; `python -m
heron.bench.kernels --moe [--sweep]` times them against the grouped GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from heron.kernels.activation import gated_act
from heron.kernels.common import pdl_enter, pdl_options
from heron.kernels.moe_routing import route, route_constants
from heron.kernels.rmsnorm import fix_bf16, round_to


@dataclass(frozen=True)
class GemvMoeConfig:
    block_n: int  # output rows per program (of each of gate and up in the first kernel)
    block_k: int  # columns per tile
    num_warps: int = 4
    num_stages: int = 3


def default_config(rows: int, cols: int, elem_size: int) -> GemvMoeConfig:
    """Tiles of 512 bytes of each row (or the largest power of two that divides the row's bytes, from 128 up:
    a tile past the row's end loads nothing but costs an iteration), 2 warps, 8 rows a program for a weight of
    up to 1024 rows and 4 past it: many small programs, each SM holding several. The H200 sweep on
    Qwen3-30B-A3B's experts at batch 1 (`heron.bench.kernels --moe --sweep`, 2026-12-05): gate/up (768 rows)
    best at 8 x 256, down (2048 rows) at 4 x 256, both 2 warps; 28.8 us for both kernels against 35.0 with
    1 KiB tiles of 8 rows and 4 warps, and 30.3 for the grouped GEMMs with routing."""
    block_k = 512 // elem_size
    while block_k > 128 // elem_size and cols % block_k:
        block_k //= 2
    block_k = min(block_k, triton.next_power_of_2(cols))
    return GemvMoeConfig(8 if rows <= 1024 else 4, block_k, num_warps=2, num_stages=4)


@triton.jit
def _pick(values, j, K_PAD: tl.constexpr):
    """values[j] of a [K_PAD] vector, j a scalar."""
    return tl.sum(tl.where(tl.arange(0, K_PAD) == j, values, 0), axis=0)


@triton.jit
def _tile(ptrs, c, cols, EVEN: tl.constexpr):
    """A tile at `ptrs` whose last dim is columns c of `cols` (all of them in range when EVEN)."""
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=c < cols, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _up_kernel(
    x_ptr,
    logits_ptr,
    w13_ptr,
    act_ptr,
    num_experts,
    inter,
    hidden,
    stride_x,
    stride_l,
    stride_e,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    FIX_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    entry = tl.program_id(1)
    t = entry // TOP_K
    _, ids = route(logits_ptr, t, num_experts, stride_l, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    expert = _pick(ids, entry % TOP_K, K_PAD).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, inter - 1).to(tl.int64)  # clamped: unmasked loads, never stored
    kk = tl.arange(0, BLOCK_K)
    gate_ptrs = w13_ptr + expert * stride_e + rows[:, None] * hidden + kk[None, :]
    up_ptrs = gate_ptrs + inter * hidden
    x_ptrs = x_ptr + t.to(tl.int64) * stride_x + kk
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):  # gate and up tiles side by side
        x = _tile(x_ptrs + k0, k0 + kk, hidden, EVEN_K)[None, :]
        gate += tl.sum(_tile(gate_ptrs + k0, k0 + kk[None, :], hidden, EVEN_K) * x, axis=1)
        up += tl.sum(_tile(up_ptrs + k0, k0 + kk[None, :], hidden, EVEN_K) * x, axis=1)
    dtype = act_ptr.dtype.element_ty  # as silu_and_mul_ref over the rounded projections
    act = gated_act(round_to(gate, dtype, FIX_BF16), round_to(up, dtype, FIX_BF16), dtype, False, FIX_BF16)
    tl.store(act_ptr + entry.to(tl.int64) * inter + n, act, mask=n < inter)


@triton.jit
def _down_kernel(
    act_ptr,
    logits_ptr,
    w2_ptr,
    out_ptr,
    num_experts,
    inter,
    hidden,
    stride_l,
    stride_e,
    stride_o,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    FIX_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One loop over the token's k entries' tiles (entry j's I columns in tiles_per_entry tiles), so the
    loads of the next entry's weights are in flight while this one's are summed."""
    pdl_enter(PDL)
    t = tl.program_id(1)
    weights, ids = route(logits_ptr, t, num_experts, stride_l, TOP_K, K_PAD, E_PAD, RENORMALIZE)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, hidden - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    tiles_per_entry = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    total = tl.zeros([BLOCK_N], tl.float32)
    for i in tl.range(0, TOP_K * tiles_per_entry, num_stages=STAGES):
        j = i // tiles_per_entry
        c0 = (i - j * tiles_per_entry) * BLOCK_K
        expert = _pick(ids, j, K_PAD).to(tl.int64)
        w = _tile(
            w2_ptr + expert * stride_e + rows[:, None] * inter + c0 + kk[None, :], c0 + kk[None, :], inter, EVEN_K
        )
        a = _tile(act_ptr + (t * TOP_K + j).to(tl.int64) * inter + c0 + kk, c0 + kk, inter, EVEN_K)
        acc += tl.sum(w * a[None, :], axis=1)
        last = c0 + BLOCK_K >= inter  # entry j's last tile: its sum times its weight, rounded once (as the reference)
        total += tl.where(last, round_to(acc * _pick(weights, j, K_PAD), dtype, FIX_BF16).to(tl.float32), 0.0)
        acc = tl.where(last, 0.0, acc)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, round_to(total, dtype, FIX_BF16), mask=n < hidden)


def moe_gemv(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    configs: tuple[GemvMoeConfig, GemvMoeConfig] | None = None,
) -> torch.Tensor:
    """x [T, H], router_logits [T, E]; w13 [E, 2I, H] (each expert's [gate | up] rows), w2 [E, H, I] -> the sum
    of each token's top-k experts weighted by its routing (`topk_softmax`'s), [T, H] in x's dtype. `configs`
    (first kernel, second) override `default_config`."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    assert router_logits.shape == (tokens, num_experts) and router_logits.stride(-1) == 1
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, inter) and 1 <= top_k <= num_experts
    assert w13.dtype == w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous() and x.stride(-1) == 1
    up_cfg, down_cfg = configs or (
        default_config(inter, hidden, x.element_size()),
        default_config(hidden, inter, x.element_size()),
    )
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if not tokens:
        return out
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    routing = dict(route_constants(top_k, num_experts, renormalize), FIX_BF16=fix_bf16())
    routing |= pdl_options(x.device, tokens)
    _up_kernel[(triton.cdiv(inter, up_cfg.block_n), tokens * top_k)](
        x, router_logits, w13, act, num_experts, inter, hidden, x.stride(0), router_logits.stride(0),
        w13.stride(0), BLOCK_N=up_cfg.block_n, BLOCK_K=up_cfg.block_k, STAGES=up_cfg.num_stages,
        EVEN_K=hidden % up_cfg.block_k == 0, num_warps=up_cfg.num_warps, num_stages=up_cfg.num_stages, **routing,
    )  # fmt: skip
    _down_kernel[(triton.cdiv(hidden, down_cfg.block_n), tokens)](
        act, router_logits, w2, out, num_experts, inter, hidden, router_logits.stride(0), w2.stride(0),
        out.stride(0), BLOCK_N=down_cfg.block_n, BLOCK_K=down_cfg.block_k, STAGES=down_cfg.num_stages,
        EVEN_K=inter % down_cfg.block_k == 0, num_warps=down_cfg.num_warps, num_stages=down_cfg.num_stages,
        **routing,
    )  # fmt: skip
    return out
