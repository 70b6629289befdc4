"""The routed experts of a sparse mixture-of-experts MLP on the GPU, in the style of vLLM's fused_moe.

A token's router picks k of E SwiGLU experts; out = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over its k
picks e = ids[j]. `fused_moe` is the door: a step of one token (`GEMV_MAX_TOKENS`: batch 1 at decode) goes
to the two GEMV launches of heron/kernels/moe_gemv.py, which route inside their programs; a larger one is
computed as its T * k (token, expert) entries in four launches, each a grid fixed by the shapes with nothing
read back to the host, so a CUDA graph replays a decode step:

1. `topk_softmax` (heron/kernels/moe_routing.py): router logits [T, E] -> each token's k experts (int32) and
   weights (float32).
2. `moe_align_block_size`: the entries grouped by expert, each expert's run padded to a multiple of BLOCK_M,
   by one program: `sorted_ids` (an entry's index t * k + j, or T * k in a padding slot), `expert_ids` (the
   expert of each block of BLOCK_M slots) and the padded total. Slots past the total are never read. A batch
   of a few tokens (`per_entry`: decode batches up to 4) skips it: each entry is a block of its own.
3. The grouped GEMM, one launch per projection over all experts (`_fused_moe_kernel`): program (m, n) takes
   block m of the sorted entries, all of one expert, and output columns [n * BLOCK_N, (n + 1) * BLOCK_N) of
   it, streaming that expert's weight tile; its rows are the entries' tokens gathered from A. The grid is sized
   for the worst case (`max_padded_slots`); blocks past the padded total return at once. The first projection
   (w13, each expert's [gate | up] rows) computes the gate and up tiles together and stores silu(gate) * up
   [T * k, I]; the second (w2) scales each row by its routing weight and stores [T * k, H].
4. `moe_sum`: each token's k rows summed in float32 (the weighted combine).

An expert's weights are read once per block of its entries, so at decode BLOCK_M is the least that holds an
expert's entries (16, tl.dot's least, up to 32), and the GEMMs stream only the experts the batch touches.

Rounding follows the PyTorch reference (`heron.kernels.reference.fused_experts_ref`): the gate and up sums
are rounded to the activation dtype, silu(gate) rounded, times up rounded (as `silu_and_mul_ref`); the down sum
is scaled by the float32 weight in float32 and rounded once; the k rows are summed in float32 and rounded.

Configs: `default_config` (a rule from the rows per expert), overridden by `CONFIGS` (shapes tuned on a GPU) or
per call by `config=`. No triton.autotune: its first-call benchmarking cannot run under graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from heron.kernels.activation import gated_act
from heron.kernels.common import dot_upcast
from heron.kernels.moe_gemv import moe_gemv
from heron.kernels.moe_routing import topk_softmax
from heron.kernels.rmsnorm import fix_bf16, round_to


@dataclass(frozen=True)
class MoeGemmConfig:
    block_m: int  # entries per program (slots of one expert); the alignment of each expert's run
    block_n: int
    block_k: int
    group_m: int = 1  # programs ordered by groups of this many m-blocks (weight tiles reused from L2)
    num_warps: int = 4
    num_stages: int = 3


# (tokens rounded up to a power of two, E, I, H, k) -> config for 16-bit dtypes, consulted before
# `default_config`. From `python -m heron.bench.kernels --moe --sweep --rows 1,2,4,8,16` on the H200 (2026-12-04):
# Qwen3-30B-A3B's experts at decode, 1.15-1.31x the default (T=1: 28.8 us against 34.4).
_QWEN3_30B_A3B = (128, 768, 2048, 8)
CONFIGS: dict[tuple[int, int, int, int, int], MoeGemmConfig] = {
    (1, *_QWEN3_30B_A3B): MoeGemmConfig(16, 64, 64, group_m=1, num_warps=8, num_stages=4),
    (2, *_QWEN3_30B_A3B): MoeGemmConfig(16, 128, 64, group_m=1, num_warps=8, num_stages=4),
    (4, *_QWEN3_30B_A3B): MoeGemmConfig(16, 128, 64, group_m=1, num_warps=8, num_stages=3),
    (8, *_QWEN3_30B_A3B): MoeGemmConfig(16, 64, 64, group_m=1, num_warps=8, num_stages=3),
    (16, *_QWEN3_30B_A3B): MoeGemmConfig(16, 64, 64, group_m=1, num_warps=8, num_stages=4),
}


def default_config(tokens: int, num_experts: int, top_k: int) -> MoeGemmConfig:
    """BLOCK_M follows the mean entries per expert: at decode large enough that an expert's entries rarely
    take two blocks (each block reads the expert's weights again), and no larger (16 is tl.dot's least);
    narrow column tiles while the blocks are few, so that a small decode step still has a few hundred
    programs streaming weights."""
    per_expert = tokens * top_k / num_experts
    if per_expert <= 6:
        return MoeGemmConfig(16, 32, 128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 16:  # (Poisson(16) entries fit in 32 slots: each expert's weights still read once)
        return MoeGemmConfig(32, 64, 64, group_m=1, num_warps=4, num_stages=4)
    return MoeGemmConfig(64, 128, 64, group_m=8, num_warps=8, num_stages=3)


def pick_config(
    tokens: int, num_experts: int, inter: int, hidden: int, top_k: int, dtype: torch.dtype
) -> MoeGemmConfig:
    key = (triton.next_power_of_2(tokens), num_experts, inter, hidden, top_k)
    tuned = CONFIGS.get(key) if dtype.itemsize == 2 else None
    return tuned or default_config(tokens, num_experts, top_k)


# -- 2. sorting the entries by expert -----------------------------------------------------------------------


def max_padded_slots(num_entries: int, num_experts: int, block_m: int) -> int:
    """The most slots the aligned entries can take: each expert with entries (at most min(entries, E) of them)
    pads its run by fewer than BLOCK_M slots."""
    return num_entries + min(num_entries, num_experts) * (block_m - 1)


@triton.jit
def _moe_align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    cursor_ptr,
    num_entries,
    max_blocks,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    c = tl.arange(0, CHUNK)
    # each expert's entries, its run padded to a multiple of BLOCK_M, where its run starts
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(0, num_entries, CHUNK):
        ok = start + c < num_entries
        counts += tl.histogram(tl.load(ids_ptr + start + c, mask=ok, other=0), E_PAD, mask=ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    # the expert of each block: how many runs end at or before its first slot (-1 past the total)
    for b0 in range(0, max_blocks, BLOCK_CHUNK):
        b = b0 + tl.arange(0, BLOCK_CHUNK)
        owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(b * BLOCK_M < total, owner, -1), mask=b < max_blocks)
    # the padding slots at the end of each run
    pad = tl.arange(0, BLOCK_M)
    pad_slot = (starts + counts)[:, None] + pad[None, :]
    tl.store(sorted_ids_ptr + pad_slot, num_entries, mask=pad[None, :] < (padded - counts)[:, None])
    # each entry to the next free slot of its expert's run (this program's atomics: the order within a run
    # varies from call to call, and no entry's result depends on it)
    tl.store(cursor_ptr + e, starts)
    tl.debug_barrier()
    for start in range(0, num_entries, CHUNK):
        ok = start + c < num_entries
        ids = tl.load(ids_ptr + start + c, mask=ok, other=0)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=ok, sem="relaxed", scope="cta")
        tl.store(sorted_ids_ptr + slot, start + c, mask=ok)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids int32 [max_padded_slots], expert_ids int32 [blocks], total int32 [1]).
    One program: at decode one launch costs more than its work (a histogram and N atomic increments)."""
    num_entries = topk_ids.numel()
    slots = max_padded_slots(num_entries, num_experts, block_m)
    blocks = triton.cdiv(slots, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max(slots, 1), dtype=torch.int32, device=device)
    expert_ids = torch.empty(max(blocks, 1), dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    if not num_entries:
        total.zero_()
    else:
        e_pad = triton.next_power_of_2(num_experts)
        _moe_align_kernel[(1,)](
            topk_ids.reshape(-1),
            sorted_ids,
            expert_ids,
            total,
            torch.empty(e_pad, dtype=torch.int32, device=device),
            num_entries,
            blocks,
            E_PAD=e_pad,
            BLOCK_M=block_m,
            CHUNK=1024,
            BLOCK_CHUNK=max(16, 8192 // e_pad),
            num_warps=8,
        )
    return sorted_ids, expert_ids, total


# -- 3. the grouped GEMM ------------------------------------------------------------------------------------


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    N,
    K,
    num_entries,
    num_slots,
    up_offset,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    ROWS_PER_TOKEN: tl.constexpr,
    PER_ENTRY: tl.constexpr,
    SWIGLU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """C[entry, n] = A[entry // ROWS_PER_TOKEN] . B[expert, n] over the sorted entries; SWIGLU: B's rows n and
    up_offset + n are gate and up, C = silu(gate) * up; MUL_WEIGHT: C = weight[entry] * (A . B). PER_ENTRY:
    block m is entry m alone, expert_ids the entries' experts (no sorting)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(num_slots, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if PER_ENTRY:
        entry = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_entries)
    else:
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        entry = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entry < num_entries
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    row = tl.where(valid, entry // ROWS_PER_TOKEN, 0).to(tl.int64)  # padding reads row 0, never stored
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + kk[None, :]
    b_ptrs = b_ptr + expert * stride_be + tl.minimum(n, N - 1).to(tl.int64)[None, :] * stride_bn + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = k0 + kk < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SWIGLU:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_offset * stride_bn)
            else:
                b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=k_ok[:, None], other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = c_ptr.dtype.element_ty
    if SWIGLU:  # as silu_and_mul_ref over the rounded projections
        gate, up = round_to(acc, dtype, FIX_BF16), round_to(acc_up, dtype, FIX_BF16)
        acc = gated_act(gate, up, dtype, False, FIX_BF16).to(tl.float32)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + entry, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + entry.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c_ptrs, round_to(acc, dtype, FIX_BF16), mask=valid[:, None] & (n < N)[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor | None,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor,
    rows_per_token: int,
    cfg: MoeGemmConfig,
    swiglu: bool,
) -> None:
    """routing: `moe_align_block_size`'s (sorted_ids, expert_ids, total), or the entries' experts [T * k]
    (a block per entry)."""
    per_entry = isinstance(routing, torch.Tensor)
    sorted_ids, expert_ids, total = (routing,) * 3 if per_entry else routing
    n_out, k = out.shape[1], a.shape[1]
    num_slots = out.shape[0] * cfg.block_m if per_entry else sorted_ids.numel()
    grid = (triton.cdiv(num_slots, cfg.block_m) * triton.cdiv(n_out, cfg.block_n),)
    _fused_moe_kernel[grid](
        a,
        b,
        out,
        weights if weights is not None else a,
        sorted_ids,
        expert_ids,
        total,
        n_out,
        k,
        out.shape[0],
        num_slots,
        n_out if swiglu else 0,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        ROWS_PER_TOKEN=rows_per_token,
        PER_ENTRY=per_entry,
        SWIGLU=swiglu,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0,
        UPCAST=dot_upcast(),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FIX_BF16=fix_bf16(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# -- 4. the weighted combine --------------------------------------------------------------------------------


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, FIX_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, round_to(acc, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


def moe_sum(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """y [T * k, H] (contiguous) -> the sum of each token's k rows [T, H], in float32, rounded once."""
    rows, hidden = y.shape
    out = torch.empty(rows // top_k, hidden, dtype=y.dtype, device=y.device)
    if rows:
        block = min(1024, triton.next_power_of_2(hidden))
        _moe_sum_kernel[(rows // top_k, triton.cdiv(hidden, block))](
            y, out, hidden, TOP_K=top_k, BLOCK=block, FIX_BF16=fix_bf16(), num_warps=4 if block >= 512 else 1
        )
    return out


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: MoeGemmConfig | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (each expert's [gate | up] rows), w2 [E, H, I]; topk_weights float32 and
    topk_ids int32 [T, k] (`topk_softmax`) -> sum_j topk_weights[:, j] * expert_{ids[:, j]}(x) [T, H], in x's
    dtype. `config` overrides `pick_config`."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, inter)
    assert w13.dtype == w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous() and x.stride(-1) == 1
    cfg = config or pick_config(tokens, num_experts, inter, hidden, top_k, x.dtype)
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    if tokens:
        if per_entry(tokens, num_experts, top_k):
            routing = topk_ids.reshape(-1)
        else:
            routing = moe_align_block_size(topk_ids, cfg.block_m, num_experts)
        _grouped_gemm(x, w13, act, None, routing, top_k, cfg, swiglu=True)
        _grouped_gemm(act, w2, y, topk_weights.reshape(-1), routing, 1, cfg, swiglu=False)
    return moe_sum(y, top_k)


# Steps of up to this many tokens take `moe_gemv`. On the H200 (Qwen3-30B-A3B's experts, 2026-12-05): at one
# token 28.8 us a layer against 30.3 for the grouped path; at 2 and 4 tokens the GEMVs, with configs not yet
# tuned for them, lost (53.4 against 48.0, 93.5 against 77.0 us): `heron.bench.kernels --moe` times both.
GEMV_MAX_TOKENS = 1


def fused_moe(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool
) -> torch.Tensor:
    """x [T, H], router_logits [T, E]; w13 [E, 2I, H], w2 [E, H, I] -> the sum of each token's top-k experts
    weighted by its routing (softmax, renormalised over the k if `renormalize`), [T, H] in x's dtype."""
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return moe_gemv(x, router_logits, w13, w2, top_k, renormalize)
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids)


def per_entry(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether the GEMMs take a block per (token, expert) entry instead of sorting the entries: for a batch so
    small that its tokens rarely share an expert (T * k <= E / 4; one token's k experts are distinct), where
    the alignment launch costs more than the few experts read twice."""
    return 4 * tokens * top_k <= num_experts
