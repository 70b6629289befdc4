"""Gathered multi-LoRA: y += (x A[s]^T) B[s] for every token of a batch, each token with its own adapter slot s
(-1: none), in two launches per projection (shrink, then expand-and-add) whatever the mix of adapters: Punica's
BGMV/SGMV as vLLM's Triton LoRA kernels do it. `lora_shrink` returns the shrink's output as a `LoRADelta`, which
the matmul door hands to the base projection: at batch 1 the decode GEMV adds the delta in its epilogue
(heron/kernels/gemv.py) and the expand's launch is saved.

Layout (heron/layers/lora.py's LoRAStack): A [S, P*R, in] and B [S, P*R, out] (transposed, scaled), B
block-diagonal over the P parts of a fused projection: part p's R rank rows feed only its output columns.
The step's tokens come grouped by slot (heron/layers/lora.py's `LoRAMapping`, filled on the host with the
step's other inputs): `sorted_tokens` lists the adapted rows slot by slot, `slot_start[s]:slot_start[s + 1]` is
slot s's run.

- shrink, program (m, j, s): the m-th BLOCK_M of the adapted rows in slot order, gathered, times rank rows
  [j * BLOCK_R, +BLOCK_R) of their adapter's A, over the s-th range of `in` (split-K) in BLOCK_K tiles with
  tl.dot -> a float32 partial in a [splits, T, P*R] buffer. A tile that crosses from one slot's run into the
  next takes one pass per slot, the other rows masked to zero (one accumulator).
  Its input is x, or made from x on load (`PROLOGUE`): act(gate) * up from a gated MLP's [gate | up] (a
  down projection's), or h * weight from the residual stream h (a pre-norm block's normed input, whose
  1 / rms(h) factors out of the sums: each split also stores its rows' sums of squares of h). Either saves the
  launch that would make the input.
- expand, program (m, i): the same rows' shrunk values (the splits' partials summed in order on load; or, from
  `extended_delta`, the columns of a base product by every slot's A rows, each row's slot's P*R of them) times
  their adapter's B, columns [i * BLOCK_N, +BLOCK_N), reading only the rank rows of the parts those columns
  belong to, added to y (rounded once) in place. After a norm prologue the shrunk values are first scaled by
  1 / rms(h) from the splits' sums of squares.

- expand inside the activation (`LoRADelta.act_and_mul`, a gated MLP's gate/up past 16 rows), program (m, i):
  rows [m * BLOCK_M, +BLOCK_M) of every row (`sorted_tokens` lists the base model's rows after the adapted ones),
  gate's and up's columns [i * BLOCK_N, +BLOCK_N) of y, each plus its part's delta (as the expand, rounded once),
  then act(gate) * up stored: y is read once and the activation alone written.

Split-K because the shrink has few programs at decode sizes: (T / 16) x (P*R / 16), 16 for a down_proj of a
256-row step, 1 at batch 1, each walking all of `in` (12,288 columns for Qwen3-8B's down_proj) one dependent
tile after another. `shrink_splits` cuts `in` until the grid covers the GPU twice; a prefill step's grid
already does, and keeps one split. Summing the partials in the expand costs no launch and stays deterministic
(no atomics into a zeroed buffer).

So an adapter's matrices are read once per BLOCK_M of its tokens, not once per token (BGMV) nor once per slot
for every token (the dense product over all slots, `lora_ref`, which the CPU runs), and the grid,
(ceil(T / BLOCK_M), tiles), has no slot axis of programs with nothing to do: only the tiles past the adapted
rows (a batch's base-model tokens) return at once. It depends only on shapes, and the runs are read on the
device: no host sync, CUDA-graph safe (a graph's padding rows have slot -1 and are in no run). Each row is in
one tile, so no two programs write one element of y.

Length: the shrink, the expand and the expand inside the activation read one layout (the shrink's partials, the
rows by slot, B by parts) through `LoRADelta`; apart, that layout would be spread over three files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from heron.kernels.activation import gated_act
from heron.kernels.common import dot_upcast, num_sms
from heron.kernels.rmsnorm import fix_bf16, round_to

# Tiles and launch options, the door to them (`benchmarks/lora_probe.py` sweeps them at Qwen3-8B's shapes): the
# shrink's token, rank and `in` tiles for steps of up to TILE_ROWS tokens (the GEMV's decode sizes: narrower `in`
# tiles on 2 warps, so more split-K programs; batch 1 1.5% faster, H100, session 25) and for larger ones
# (`shrink_tiles` picks), the expand's token and output-column tiles.
TILE_ROWS = 16
SHRINK = (
    dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=64, num_warps=2, num_stages=3),
    dict(BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, num_warps=4, num_stages=3),
)
EXPAND = dict(BLOCK_M=16, BLOCK_R=16, BLOCK_N=128, num_warps=4, num_stages=3)
MAX_PARTS = 3  # q/k/v
# the shrink's prologue: what x is and how the matrix's input is made from it
SILU, GELU_TANH, NORM = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
ACTS = {"silu": SILU.value, "gelu_tanh": GELU_TANH.value}


@triton.jit
def _tile_tokens(slots_ptr, sorted_ptr, start_ptr, m, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile m of the adapted rows in slot order: the rows, which are real, each one's slot, and the range of
    slots the tile spans (empty for a tile past the adapted rows)."""
    idx = m * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = idx < tl.load(start_ptr + NUM_SLOTS)
    rows = tl.load(sorted_ptr + idx, mask=ok, other=0)
    slots = tl.load(slots_ptr + rows, mask=ok, other=-1)
    first, last = tl.min(tl.where(ok, slots, NUM_SLOTS)), tl.max(slots)
    return rows.to(tl.int64), ok, slots, first, last


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    sorted_ptr,
    start_ptr,
    out_ptr,
    nw_ptr,
    ss_ptr,
    res_ptr,
    K,
    K_SPLIT,
    R2,
    stride_x,
    stride_r,
    stride_as,
    stride_ar,
    stride_split,
    stride_o,
    stride_ss,
    NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    m, j, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, ok, slots, first, last = _tile_tokens(slots_ptr, sorted_ptr, start_ptr, m, NUM_SLOTS, BLOCK_M)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    ranks = j * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < R2
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM: each row's, over this split's range of x
    for slot in range(first, last + 1):  # one slot, or a few where the tile crosses runs
        mine = ok & (slots == slot)  # the other rows load as zero: one accumulator for all
        a_rows = a_ptr + slot * stride_as + ranks.to(tl.int64)[None, :] * stride_ar
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            x_ptrs, x_mask = x_ptr + rows[:, None] * stride_x + ks[None, :], mine[:, None] & k_ok[None, :]
            if PROLOGUE == SILU or PROLOGUE == GELU_TANH:  # x: [gate | up], K columns each
                gate = tl.load(x_ptrs, mask=x_mask, other=0.0)
                up = tl.load(x_ptrs + K, mask=x_mask, other=0.0)
                x = gated_act(gate, up, dtype, PROLOGUE == GELU_TANH, FIX_BF16)
            elif PROLOGUE == NORM:  # h = x (+ residual); h * weight here, 1 / rms(h) on the sums after
                h = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:  # rounded as torch rounds x + residual
                    r = tl.load(res_ptr + rows[:, None] * stride_r + ks[None, :], mask=x_mask, other=0.0)
                    h = round_to(h + r.to(tl.float32), dtype, FIX_BF16).to(tl.float32)
                sum_sq += tl.sum(h * h, axis=1)
                x = round_to(h * tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :], dtype, FIX_BF16)
            else:
                x = tl.load(x_ptrs, mask=x_mask, other=0.0)
            a = tl.load(a_rows + ks[:, None], mask=k_ok[:, None] & rank_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
            if UPCAST:
                x, a = x.to(tl.float32), a.to(tl.float32)
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
    out = out_ptr + split * stride_split + rows[:, None] * stride_o + ranks[None, :]
    tl.store(out, acc, mask=ok[:, None] & rank_ok[None, :])
    if PROLOGUE == NORM:
        tl.store(ss_ptr + split * stride_ss + rows, sum_sq, mask=ok & (j == 0))


@triton.jit(do_not_specialize=["SPLITS"])  # 1 past ~2,000 tokens: one binary for any split count
def _expand_add_kernel(
    y_ptr,
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    sorted_ptr,
    start_ptr,
    ss_ptr,
    N,
    OFF1,
    OFF2,
    MAX_RANK,
    SPLITS,
    K,
    eps,
    stride_y,
    stride_split,
    stride_s,
    stride_slot,
    stride_bs,
    stride_br,
    stride_ss,
    NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NORMED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m, i = tl.program_id(0), tl.program_id(1)
    rows, ok, slots, first, last = _tile_tokens(slots_ptr, sorted_ptr, start_ptr, m, NUM_SLOTS, BLOCK_M)
    if NORMED:  # the shrink's input was h * weight: its sums times 1 / rms(h), from the splits' sums of squares
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for split in range(SPLITS):
            sum_sq += tl.load(ss_ptr + split * stride_ss + rows, mask=ok, other=0.0)
        inv_rms = tl.math.rsqrt(sum_sq / K + eps)
    cols = i * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # the parts of this column tile: B's other rank rows are zero here (block-diagonal), so are skipped
    col_first, col_last = i * BLOCK_N, tl.minimum(i * BLOCK_N + BLOCK_N, N) - 1
    part_lo = (col_first >= OFF1).to(tl.int32) + (col_first >= OFF2).to(tl.int32)
    part_hi = (col_last >= OFF1).to(tl.int32) + (col_last >= OFF2).to(tl.int32)
    r_end = (part_hi + 1) * MAX_RANK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(first, last + 1):
        mine = ok & (slots == slot)
        b_cols = b_ptr + slot * stride_bs + cols[None, :]
        for r0 in range(part_lo * MAX_RANK, r_end, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < r_end
            s_ptrs = shrunk_ptr + rows[:, None] * stride_s + slot * stride_slot + ranks[None, :]
            s_mask = mine[:, None] & rank_ok[None, :]
            s = tl.load(s_ptrs, mask=s_mask, other=0.0)
            for split in range(1, SPLITS):
                s += tl.load(s_ptrs + split * stride_split, mask=s_mask, other=0.0)
            if NORMED:
                s *= inv_rms[:, None]
            b = tl.load(
                b_cols + ranks.to(tl.int64)[:, None] * stride_br, mask=rank_ok[:, None] & col_ok[None, :], other=0.0
            )
            if UPCAST:
                s, b = s.to(tl.float32), b.to(tl.float32)
            else:
                s = s.to(b.dtype)  # tensor cores take both operands in the model's dtype
            acc = tl.dot(s, b, acc, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@triton.jit(do_not_specialize=["SPLITS"])  # 1 past ~2,000 tokens: one binary for any split count
def _expand_act_kernel(
    y_ptr,
    out_ptr,
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    sorted_ptr,
    start_ptr,
    T,
    INTER,
    MAX_RANK,
    SPLITS,
    stride_y,
    stride_o,
    stride_split,
    stride_s,
    stride_slot,
    stride_bs,
    stride_br,
    NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GELU_TANH: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    m, i = tl.program_id(0), tl.program_id(1)
    idx = m * BLOCK_M + tl.arange(0, BLOCK_M)  # every row: the adapted ones by slot, then the base model's
    valid = idx < T
    rows = tl.load(sorted_ptr + idx, mask=valid, other=0).to(tl.int64)
    adapted = idx < tl.load(start_ptr + NUM_SLOTS)
    slots = tl.load(slots_ptr + rows, mask=adapted, other=-1)
    first, last = tl.min(tl.where(adapted, slots, NUM_SLOTS)), tl.max(slots)
    cols = i * BLOCK_N + tl.arange(0, BLOCK_N)  # of gate; up's are INTER on
    col_ok = cols < INTER
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(first, last + 1):
        mine = adapted & (slots == slot)
        b_cols = b_ptr + slot * stride_bs + cols[None, :]
        for r0 in range(0, MAX_RANK, BLOCK_R):  # gate's rank rows; up's are MAX_RANK on
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < MAX_RANK
            s_ptrs = shrunk_ptr + rows[:, None] * stride_s + slot * stride_slot + ranks[None, :]
            s_mask = mine[:, None] & rank_ok[None, :]
            s_gate = tl.load(s_ptrs, mask=s_mask, other=0.0)
            s_up = tl.load(s_ptrs + MAX_RANK, mask=s_mask, other=0.0)
            for split in range(1, SPLITS):
                s_gate += tl.load(s_ptrs + split * stride_split, mask=s_mask, other=0.0)
                s_up += tl.load(s_ptrs + split * stride_split + MAX_RANK, mask=s_mask, other=0.0)
            b_ptrs = b_cols + ranks.to(tl.int64)[:, None] * stride_br
            b_mask = rank_ok[:, None] & col_ok[None, :]
            b_gate = tl.load(b_ptrs, mask=b_mask, other=0.0)
            b_up = tl.load(b_ptrs + MAX_RANK * stride_br + INTER, mask=b_mask, other=0.0)
            if UPCAST:
                s_gate, s_up = s_gate.to(tl.float32), s_up.to(tl.float32)
                b_gate, b_up = b_gate.to(tl.float32), b_up.to(tl.float32)
            else:
                s_gate, s_up = s_gate.to(b_gate.dtype), s_up.to(b_up.dtype)
            acc_gate = tl.dot(s_gate, b_gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(s_up, b_up, acc_up, input_precision=PRECISION)
    mask = valid[:, None] & col_ok[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + acc_gate).to(dtype)  # rounded as the expand's
    up = (tl.load(y_ptrs + INTER, mask=mask, other=0.0).to(tl.float32) + acc_up).to(dtype)
    out = gated_act(gate, up, dtype, GELU_TANH, FIX_BF16)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out, mask=mask)


@triton.jit
def lora_row_b(
    b_ptr,
    slot_ptr,
    tile,
    n,
    N,
    OFF1,
    OFF2,
    MAX_RANK,
    stride_bs,
    stride_br,
    R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """For a one-row GEMV's output columns n (heron/kernels/gemv.py): the row's slot, its adapter's B rows of
    the parts these columns belong to ([R_PAD, BLOCK_N], zeros elsewhere) and which rank rows those are (none
    without an adapter, slot -1, or for a tile < 0). Loaded before the GEMV's main loop, so that its epilogue
    waits only for the shrink's sums (`lora_row_sums`)."""
    slot = tl.load(slot_ptr)
    col_first = tile * BLOCK_N
    col_last = tl.minimum(col_first + BLOCK_N, N) - 1
    part_lo = (col_first >= OFF1).to(tl.int32) + (col_first >= OFF2).to(tl.int32)
    part_hi = (col_last >= OFF1).to(tl.int32) + (col_last >= OFF2).to(tl.int32)
    r = tl.arange(0, R_PAD)
    r_ok = (r >= part_lo * MAX_RANK) & (r < (part_hi + 1) * MAX_RANK) & (slot >= 0) & (tile >= 0)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + r.to(tl.int64)[:, None] * stride_br
    b = tl.load(b_rows + tl.maximum(tl.minimum(n, N - 1), 0)[None, :], mask=r_ok[:, None], other=0.0)
    return slot, b, r_ok


@triton.jit
def lora_row_sums(part_ptr, r_ok, SPLITS, stride_split, R_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """The shrink's sums of row 0 on the rank rows `r_ok` (float32 [R_PAD]), all of its splits' partials read
    in one load; times `lora_row_b`'s B rows they are the row's delta."""
    r = tl.arange(0, R_PAD)
    sp = tl.arange(0, S_PAD)
    s_mask = (sp < SPLITS)[:, None] & r_ok[None, :]
    s_ptrs = part_ptr + sp[:, None] * stride_split + r[None, :]
    return tl.sum(tl.load(s_ptrs, mask=s_mask, other=0.0, cache_modifier=".cg"), axis=0)


def shrink_tiles(tokens: int, config: dict | None = None) -> dict:
    """SHRINK's entry for a step of `tokens`, with `config`'s overrides (the probe's)."""
    cfg = SHRINK[tokens > TILE_ROWS]
    return cfg if config is None else {**cfg, **config}


def shrink_splits(tokens: int, rank_rows: int, in_size: int, device: torch.device, cfg: dict | None = None) -> int:
    """How many ranges of `in` the shrink splits into: enough for its grid to cover the GPU's SMs twice, at
    most one BLOCK_K tile each (`cfg`: the tiles, `shrink_tiles`' for `tokens` if None). A function of shapes
    only, so a CUDA graph's step always takes the same."""
    cfg = shrink_tiles(tokens) if cfg is None else cfg
    programs = triton.cdiv(tokens, cfg["BLOCK_M"]) * triton.cdiv(rank_rows, cfg["BLOCK_R"])
    return max(1, min(triton.cdiv(in_size, cfg["BLOCK_K"]), triton.cdiv(2 * num_sms(device), programs)))


@dataclass
class LoRARows:
    """One projection's adapter for a one-row GEMV (heron/kernels/gemv.py) that runs the shrink itself: the
    adapter's A rows are extra tiles of the GEMV's grid, over the input its prologue makes, and the other tiles
    add (their sums) B in their epilogue once those are published. Batch-1 decode then pays no launch for the
    adapter. `shrink` runs the separate shrink instead, for a GEMV that cannot take the rows."""

    lora_a: torch.Tensor  # [S, P*R, in]
    lora_b: torch.Tensor  # [S, P*R, out]
    token_slots: torch.Tensor  # [1]: the row's slot, -1 for none
    offsets: tuple[int, int]
    max_rank: int
    shrink: Callable[[], LoRADelta]


@dataclass
class LoRADelta:
    """One projection's shrunk LoRA products for a step (the shrink's output), waiting to be expanded and added to
    the base projection's output y: by the expand kernel (`add_to_`), or at batch 1 in the base GEMV's epilogue
    (heron/kernels/gemv.py), which reads these same tensors and saves the expand's launch."""

    partials: torch.Tensor  # [splits, T, P*R] float32: the splits' sums, added in order when read (or `stride_slot`)
    sum_sq: torch.Tensor | None  # [splits, T]: a norm prologue's sums of squares of h (1 / rms is applied after)
    eps: float
    in_size: int
    lora_b: torch.Tensor
    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_start: torch.Tensor
    offsets: tuple[int, int]  # where parts 1 and 2 of the output start (N where there is none)
    max_rank: int
    # a row's sums start slot * stride_slot into its row of `partials`: 0 for the shrink's [splits, T, P*R], P*R
    # for the base GEMM's columns of every slot's A rows (`LoRAWeights.extended`: one split, [1, T, S*P*R])
    stride_slot: int = 0

    def add_to_(self, y: torch.Tensor, config: dict | None = None) -> torch.Tensor:
        """y [T, out] += each adapted token's expanded delta, in place (the expand kernel); returns y. `config`
        overrides EXPAND's entries (the probe's sweep)."""
        splits, t, _ = self.partials.shape
        n = y.shape[1]
        assert y.shape[0] == t and y.stride(-1) == 1 and n == self.lora_b.shape[2]
        sum_sq = self.sum_sq if self.sum_sq is not None else self.partials
        cfg = EXPAND if config is None else {**EXPAND, **config}  # (no merge on the engine's path)
        _expand_add_kernel[(triton.cdiv(t, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))](
            y,
            self.partials,
            self.lora_b,
            self.token_slots,
            self.sorted_tokens,
            self.slot_start,
            sum_sq,
            n,
            self.offsets[0],
            self.offsets[1],
            self.max_rank,
            splits,
            self.in_size,
            self.eps,
            y.stride(0),
            self.partials.stride(0),
            self.partials.stride(1),
            self.stride_slot,
            self.lora_b.stride(0),
            self.lora_b.stride(1),
            sum_sq.stride(0),
            NUM_SLOTS=self.lora_b.shape[0],
            NORMED=self.sum_sq is not None,
            UPCAST=dot_upcast(),
            PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
            **cfg,
        )
        return y

    def act_and_mul(self, y: torch.Tensor, gelu_tanh: bool, config: dict | None = None) -> torch.Tensor:
        """act(gate) * up of a gated MLP's gate/up output y [T, 2I] plus this delta (its two parts'), [T, I]: the
        expand and the activation in one kernel, which reads y once and writes the activation only (the expand
        alone reads and writes all of y, then the activation reads it again). Every row is written (the rows of
        `sorted_tokens` past the adapted ones are the base model's). `config` overrides EXPAND's entries."""
        splits, t, _ = self.partials.shape
        inter = y.shape[1] // 2
        assert self.sum_sq is None and self.lora_b.shape[1] == 2 * self.max_rank and self.offsets[0] == inter
        assert y.shape == (t, 2 * inter) and y.stride(-1) == 1 and self.lora_b.shape[2] == 2 * inter
        out = torch.empty(t, inter, dtype=y.dtype, device=y.device)
        cfg = EXPAND if config is None else {**EXPAND, **config}
        _expand_act_kernel[(triton.cdiv(t, cfg["BLOCK_M"]), triton.cdiv(inter, cfg["BLOCK_N"]))](
            y,
            out,
            self.partials,
            self.lora_b,
            self.token_slots,
            self.sorted_tokens,
            self.slot_start,
            t,
            inter,
            self.max_rank,
            splits,
            y.stride(0),
            out.stride(0),
            self.partials.stride(0),
            self.partials.stride(1),
            self.stride_slot,
            self.lora_b.stride(0),
            self.lora_b.stride(1),
            NUM_SLOTS=self.lora_b.shape[0],
            GELU_TANH=gelu_tanh,
            UPCAST=dot_upcast(),
            PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
            FIX_BF16=fix_bf16(),
            **cfg,
        )
        return out


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    sorted_tokens: torch.Tensor,
    slot_start: torch.Tensor,
    output_sizes: list[int],
    max_rank: int,
    splits: int | None = None,
    *,
    act: str | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    config: dict | None = None,
) -> LoRADelta:
    """The shrink of each adapted token's (u A^T) B: u A^T for the rows of x [T, ...], returned with what the
    expand needs. u is x [T, in], or made from x inside the shrink: `act` ("silu", "gelu_tanh"): x is a gated
    MLP's [gate | up] [T, 2 * in] and u = act(gate) * up (a down projection's input); `norm` (weight [in], eps):
    u = weight * rmsnorm(h), h = x + `residual` (x where None; a pre-norm block's input). `token_slots`: each
    row's slot; `sorted_tokens`, `slot_start`: the step's rows grouped by slot (see above); `output_sizes`: the
    parts of a fused projection, each fed by `max_rank` rows of B; `splits`: the split-K (`shrink_splits` if
    None); `config`: overrides of SHRINK's entries (the probe's sweep)."""
    num_slots, r2, k = lora_a.shape
    t = x.shape[0]
    assert len(output_sizes) <= MAX_PARTS and x.stride(-1) == 1 and lora_a.stride(-1) == 1
    assert lora_b.stride(-1) == 1 and (act is None or norm is None) and (residual is None or norm is not None)
    assert x.shape[-1] == (2 * k if act else k), f"x has {x.shape[-1]} columns for an input of {k}"
    cfg = shrink_tiles(t, config)
    if splits is None:
        splits = shrink_splits(t, r2, k, x.device, cfg)
    k_split = triton.cdiv(triton.cdiv(k, splits), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    splits = triton.cdiv(k, k_split)  # rounding the ranges up to whole tiles may leave fewer
    partials = torch.empty(splits, t, r2, dtype=torch.float32, device=x.device)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    sum_sq = torch.empty(splits, t, dtype=torch.float32, device=x.device) if norm is not None else None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    res = residual if residual is not None else x
    _shrink_kernel[(triton.cdiv(t, cfg["BLOCK_M"]), triton.cdiv(r2, cfg["BLOCK_R"]), splits)](
        x,
        lora_a,
        token_slots,
        sorted_tokens,
        slot_start,
        partials,
        norm_weight,
        sum_sq if sum_sq is not None else partials,
        res,
        k,
        k_split,
        r2,
        x.stride(0),
        res.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        partials.stride(0),
        partials.stride(1),
        sum_sq.stride(0) if sum_sq is not None else 0,
        NUM_SLOTS=num_slots,
        PROLOGUE=NORM.value if norm is not None else ACTS[act] if act else 0,
        HAS_RESIDUAL=residual is not None,
        UPCAST=dot_upcast(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # a float32 model's sums stay float32
        FIX_BF16=fix_bf16(),
        **cfg,
    )
    offsets = part_offsets(output_sizes, lora_b.shape[2])
    return LoRADelta(partials, sum_sq, eps, k, lora_b, token_slots, sorted_tokens, slot_start, offsets, max_rank)


def part_offsets(output_sizes: list[int], n: int) -> tuple[int, int]:
    """Where parts 1 and 2 of a fused projection's n output columns start (n where there is none)."""
    offsets = [sum(output_sizes[: p + 1]) for p in range(len(output_sizes) - 1)] + [n] * MAX_PARTS
    return offsets[0], offsets[1]


def extended_delta(weights: LoRAWeights, y: torch.Tensor, n: int) -> LoRADelta:
    """The delta whose sums are the columns of y [T, n + S*P*R] past n: a product by `weights.extended`, every
    slot's A rows under the base weight, so the base's own GEMM ran every slot's shrink."""
    sums = y[:, n:].unsqueeze(0)  # [1, T, S*P*R]: row t's slot s at s * P*R
    a = weights.lora_a
    offsets = part_offsets(weights.output_sizes, n)
    return LoRADelta(
        sums, None, 0.0, a.shape[2], weights.lora_b, weights.token_slots, weights.sorted_tokens,
        weights.slot_start, offsets, weights.max_rank, stride_slot=a.shape[1],
    )  # fmt: skip


@dataclass
class LoRAWeights:
    """One projection's adapter slots and the step's rows by slot (heron/layers/lora.py's LoRAStack hands them to
    the matmul door with the base projection): the door runs the shrink on the input its path has, the base's
    own input past 16 rows (after the norm or activation kernel the base runs there), x made into it inside the
    shrink at decode sizes (where that op runs in the GEMV's prologue and its output is never written)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_start: torch.Tensor
    output_sizes: list[int]
    max_rank: int
    # a gated MLP's pair, sharing one box: gate/up `gives` its delta past 16 rows to the activation that reads its
    # output, the down projection's door (which `takes` it), instead of expanding it into gate/up's output
    gives: list[LoRADelta | None] | None = None
    takes: list[LoRADelta | None] | None = None
    # [N + S*P*R, in]: the base weight (its first N rows) with every slot's A rows under it (heron/layers/lora.py's
    # LoRAStack.extend), so that one GEMM of more than one row makes the base's output and every slot's shrink
    extended: torch.Tensor | None = None

    def extends(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the door runs `weight`'s product over x as the extended one: more than one row (one row: the
        GEMV's epilogue takes the shrink's sums of the row's own slot), no bias, `weight` the base's."""
        ext = self.extended
        return (
            ext is not None and bias is None and x.dim() == 2 and x.shape[0] > 1 and weight.data_ptr() == ext.data_ptr()
        )

    def finish_extended(self, y: torch.Tensor) -> torch.Tensor:
        """The base's output from the extended product y [T, N + S*P*R] (`extends`): its first N columns, with
        the delta from the rest added (`finish`)."""
        n = y.shape[1] - self.lora_a.shape[0] * self.lora_a.shape[1]
        return self.finish(y[:, :n], extended_delta(self, y, n))

    def finish(self, y: torch.Tensor, delta: LoRADelta) -> torch.Tensor:
        """The base projection's output y with `delta` added (the expand kernel), or, where this projection
        `gives`, y as it is and the delta left for the activation after it."""
        if self.gives is None:
            return delta.add_to_(y)
        self.gives[0] = delta
        return y

    def take(self) -> LoRADelta | None:
        """The delta that the gate/up projection before this one left for its activation (`finish`), or None."""
        if self.takes is None:
            return None
        delta, self.takes[0] = self.takes[0], None
        return delta

    def for_gemv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        act: str | None = None,
        norm: tuple[torch.Tensor, float] | None = None,
        residual: torch.Tensor | None = None,
    ) -> LoRARows | LoRADelta:
        """What the GEMV of `weight` over x takes: at one row and a weight of the adapters' dtype (not float8) the
        A rows for its own grid, else the shrink's output (its arguments as `shrink`'s)."""
        if x.numel() == x.shape[-1] and weight.dtype == self.lora_a.dtype:
            offsets = part_offsets(self.output_sizes, self.lora_b.shape[2])
            shrink = lambda: self.shrink(x, act=act, norm=norm, residual=residual)  # noqa: E731
            return LoRARows(self.lora_a, self.lora_b, self.token_slots, offsets, self.max_rank, shrink)
        return self.shrink(x, act=act, norm=norm, residual=residual)

    def shrink(
        self,
        x: torch.Tensor,
        *,
        act: str | None = None,
        norm: tuple[torch.Tensor, float] | None = None,
        residual: torch.Tensor | None = None,
    ) -> LoRADelta:
        """`lora_shrink` of these weights over x (its `act`, `norm` and `residual` as there)."""
        return lora_shrink(
            x,
            self.lora_a,
            self.lora_b,
            self.token_slots,
            self.sorted_tokens,
            self.slot_start,
            self.output_sizes,
            self.max_rank,
            act=act,
            norm=norm,
            residual=residual,
        )
