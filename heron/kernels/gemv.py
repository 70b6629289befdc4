"""y = x @ W^T (+ bias) for a decode batch: x [M, K] with M <= 16, W [N, K] (nn.Linear's layout).

At decode the weight GEMMs are memory-bound (each weight byte is used by M <= 16 rows), and cuBLAS's
small-M kernels read Qwen3-0.6B's matrices at 1.1-1.5 TB/s of the H200's ~4 TB/s. Here program (i, s) owns
output rows [i * BLOCK_N, (i + 1) * BLOCK_N) and streams its [BLOCK_N, K] slab of W (its s-th K range under
split-K) in [BLOCK_N, BLOCK_K] tiles, each multiplied by all M rows of x at once (x is tiny and stays in cache).
Two inner products, picked per config:
- `dot`: tl.dot(W tile, x^T tile) on tensor cores with the rows of x padded to 16 (tl.dot's minimum); W is the
  left operand, so BLOCK_N >= 64 uses Hopper's wgmma (smaller tiles mma.sync).
- FMA (M == 1 only): the plain GEMV on the CUDA cores, each tile's w * x summed over its BLOCK_K columns into
  BLOCK_N float32 sums; no padding.
Either way the K loop is a `tl.range` with `num_stages`: Triton then streams W (and x) through shared memory
with cp.async, `num_stages - 1` tiles ahead (the kernel-level option alone pipelines only loads feeding a dot;
checked in the sm_90 PTX).
Rows past N and x rows past M are clamped to the last valid one, so the loads need no masks (and stay
vectorised); their results are never stored. Accumulation is float32; the output is rounded once to x's dtype
(the tests' reference: F.linear in float32).

Split-K (a second grid dimension over K) serves matrices with few output rows for the SM count (N 1024 gives
16 tiles of 64 rows for 132 SMs). Each split stores its float32 partial sums to a workspace, then bumps the
tile's arrival counter (an acq_rel atomic after a CTA barrier, which publishes all of the CTA's stores); the
split that arrives last sums the partials in split order, adds the bias, stores the output and resets the
counter to zero for the next call. Chosen over the alternatives because:
- one launch: a separate reduce kernel would add a launch and a drain/fill of the GPU per GEMM, as costly as
  the whole GEMM for a 1-2 us matrix (cuBLAS's split-K reduce is what makes Qwen3-0.6B's down_proj 6.5 us);
- deterministic: partials are summed in a fixed order, unlike float32 atomics into a zeroed buffer (which
  would also need a zeroing and a casting kernel);
- graph-capturable: the grid depends only on (M, N, K) and the config, nothing is read back to the host, and
  the counters are left zeroed by every call. The workspace (partials + counters) is either passed in
  (`make_workspace`) or one shared per device, grown only by an eager call (growth under capture is an error;
  the model runner runs every batch size eagerly before capturing) and never freed: outgrown ones are kept,
  since captured graphs still point at them. Calls sharing a workspace must not run concurrently (one stream).

Prologues: the elementwise op that produces x can run inside the GEMV instead of a kernel of its own (at batch
1 a small kernel costs as much as its launch, ~2 us with the gap after it, and a decoder layer had four):
- `gemv_silu_mul`: x is the gate/up projection [M, 2K]; each tile of x is silu(gate) * up, computed on load.
- `gemv_rms_norm`: x is RMSNorm(x + residual) * weight. 1 / rms is a per-row scalar, so it factors out of
  the product: the main loop feeds round(h * weight) (h = x + residual) to the inner product and sums h^2 on
  the side, and the epilogue scales each row's sums by 1 / rms. The programs of the first column tile
  store h, the new residual stream. Without split-K (forced), so a program sees all of K. A first version
  took 1 / rms in a pass of its own before the main loop: ~5 us of serial L2 reads per program at K 4096.
The silu prologue rounds like its own kernel (heron/kernels/activation.py); the norm prologue rounds once
(h * weight) where the unfused norm rounds twice (h / rms, then times the weight): the fused result is the
closer one to float32, and the two differ by about one bf16 rounding of the input.

Float8 weights (`weight_scale`, FP8 checkpoints and `--quantization fp8`: heron/kernels/gemm/fp8.py's layout, a
float32 scale per row): W is loaded in float8 (half the bytes of the 16-bit GEMV's tiles, so `default_config`
picks tiles by bytes), cast to x's dtype for the inner product (exact: every e4m3 value is a bf16 and an fp16),
and each output row's float32 sums are multiplied by its scale once, after the split-K partials are summed and
before the bias. x stays in 16 bits (W8A16); the prologues work unchanged. A compile-time switch (`W_SCALED`):
the 16-bit kernels are the same code as without it.

A LoRA delta is added in the epilogue of a one-row GEMV on the FMA path: each program reads its columns' rank
rows of the row's adapter B and the shrink's sums and adds their product before the single rounding. The sums
come from one of two places (`lora`, heron/kernels/lora.py):
- `LoRARows` (a 16-bit weight): the GEMV computes them itself. The adapter's A rows [P*R, K] are the grid's
  first tiles, run by the same main loop over the same prologue's input (so normed, or activated, as the
  weight's rows are). Each such tile publishes its sums to the workspace and bumps a ready counter (release);
  a weight tile's finishing program waits in its epilogue until all have (acquire), bumps a done counter while
  it loads the sums (the last resetting both), and adds the delta. The weight tiles share LORA_GROUPS pairs of
  counters (tile % LORA_GROUPS), each pair on its own 128-byte line and reset by its own group's last tile, and
  an A tile bumps every group's ready counter: one pair for all (gate/up's 768 tiles at Qwen3-8B's shapes) put
  two atomics a tile on one L2 line, one after another. No program waits on one dispatched after it: CUDA
  starts a grid's programs in order of their linear index, first axis fastest, and a weight tile finishes only
  once its last split has started, after every A tile's. Batch-1 decode with adapters pays no launch for them.
- `LoRADelta` (float8 weights: A is not of the weight's dtype): the shrink kernel ran before; the epilogue
  reads all of its split-K partials in one load, and after a norm prologue takes them times the same 1 / rms as
  the main sums. One launch more per projection.
Other shapes run the expand kernel after.

Configs: `default_config` (a rule from M, N, K, the dtype and the SM count), overridden by `CONFIGS` (tuned
shapes, 16-bit dtypes) or per call by `config=`; `python -m heron.bench.kernels --gemv --sweep` searches
them on a GPU. No triton.autotune: its first-call benchmarking cannot run under graph capture and costs start-up.

Length: one kernel with its host side and configs; the prologues, the float8 scales and the LoRA epilogue are
compile-time switches of the same main loop and launch, so splitting them would split one kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from heron.kernels.common import dot_upcast, num_sms
from heron.kernels.lora import LoRADelta, LoRARows, lora_row_b, lora_row_sums
from heron.kernels.rmsnorm import fix_bf16, round_to

MAX_M = 16
# LoRA at one row: the weight tiles' handshake counters in LORA_GROUPS independent groups (tile % LORA_GROUPS),
# each group's pair on its own 128-byte line (LINE_INTS apart), so no one L2 line takes every tile's atomics
LORA_GROUPS, LINE_INTS = 32, 32
# ... and a GEMV of more weight tiles than this takes the shrink launch instead of the A rows (every weight tile
# pays the A rows' handshake in its epilogue; the shrink launch costs one launch and a load of its sums)
LORA_ROWS_MAX_TILES = 600
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn  # a weight in float8 comes with a float32 scale per row (heron/kernels/gemm/fp8.py)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True  # tensor-core tl.dot over x's rows padded to 16; False: CUDA-core FMA, M == 1 only


# (rows, N, K) -> config for 16-bit dtypes, consulted before `default_config`; rows is 1 (the FMA GEMV) or 16
# (any 2..16 rows: the tensor-core GEMV pads them to 16, so its best config does not depend on M). From
# `python -m heron.bench.kernels --gemv --sweep` on an H200 (2026-12-02, commit 17c28ae; us: swept / default).
CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (1, 1024, 2048): GemvConfig(8, 1024, 1, num_warps=4, num_stages=3, dot=False),  # 3.8 / 4.8
    (1, 1024, 3072): GemvConfig(8, 1024, 1, num_warps=4, num_stages=3, dot=False),  # 4.5 / 5.2
    (1, 6144, 1024): GemvConfig(8, 512, 1, num_warps=4, num_stages=2, dot=False),  # 5.5 / 6.1
    (1, 4096, 4096): GemvConfig(16, 512, 1, num_warps=4, num_stages=4, dot=False),  # 10.8 / 11.7
    (1, 4096, 14336): GemvConfig(16, 512, 1, num_warps=4, num_stages=4, dot=False),  # 30.1 / 31.4
    (1, 28672, 4096): GemvConfig(32, 256, 1, num_warps=4, num_stages=2, dot=False),  # 56.9 / 59.3
    (1, 4096, 12288): GemvConfig(8, 512, 1, num_warps=4, num_stages=3, dot=False),  # 26.2 / 27.6 (3126b8a)
    # Qwen3-8B's gate/up: Llama's 28672 entry, not swept; H100 batch 1 (s30): base 5.69, LoRA 6.26 ms/token (6.29)
    (1, 24576, 4096): GemvConfig(32, 256, 1, num_warps=4, num_stages=2, dot=False),
    (16, 1024, 2048): GemvConfig(32, 128, 4, num_warps=4, num_stages=4),  # 5.0 / 6.1
    (16, 1024, 3072): GemvConfig(32, 128, 8, num_warps=4, num_stages=3),  # 5.4 / 6.1
    (16, 4096, 1024): GemvConfig(32, 128, 1, num_warps=4, num_stages=4),  # 5.1 / 6.3
    (16, 6144, 1024): GemvConfig(64, 256, 1, num_warps=4, num_stages=4),  # 5.6 / 8.8
    (16, 4096, 4096): GemvConfig(64, 256, 2, num_warps=4, num_stages=3),  # 11.7 / 15.0
    (16, 6144, 4096): GemvConfig(64, 256, 1, num_warps=4, num_stages=4),  # 15.1 / 18.4
    (16, 4096, 14336): GemvConfig(64, 256, 2, num_warps=4, num_stages=4),  # 31.6 / 35.7
    (16, 4096, 12288): GemvConfig(64, 256, 2, num_warps=4, num_stages=4),  # 28.0 / 32.1 (3126b8a)
    (16, 24576, 4096): GemvConfig(64, 128, 1, num_warps=4, num_stages=3),  # 50.2 / 52.1 (3126b8a)
    (16, 151936, 1024): GemvConfig(128, 128, 1, num_warps=4, num_stages=3),  # 75.9 / 80.6 (M 8)
}


@triton.jit
def _input_tile(x_ptr, x_offs, mask, K, PROLOGUE: tl.constexpr, FIX_BF16: tl.constexpr):
    """A tile of the GEMV's input at offsets x_offs, in x's dtype: x, or silu(gate) * up (PROLOGUE 1)."""
    if PROLOGUE == 1:  # up sits K columns after gate
        dtype = x_ptr.dtype.element_ty
        gate = _load(x_ptr + x_offs, mask).to(tl.float32)
        up = _load(x_ptr + x_offs + K, mask).to(tl.float32)
        act = round_to(gate / (1.0 + tl.exp(-gate)), dtype, FIX_BF16).to(tl.float32)
        x = round_to(act * up, dtype, FIX_BF16)
    else:
        x = _load(x_ptr + x_offs, mask)
    return x


@triton.jit
def _load(ptrs, mask):
    """tl.load, unmasked (so vectorised) when mask is None: whole tiles."""
    if mask is None:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit(do_not_specialize=["M", "split_k"])  # one binary for M 2..16 and for every split count
def _gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    res_ptr,
    nw_ptr,
    res_out_ptr,
    lora_slot_ptr,
    lora_part_ptr,
    lora_b_ptr,
    lora_a_ptr,
    lora_flag_ptr,
    M,
    N,
    K,
    k_split,
    split_k,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    stride_rom,
    eps,
    lora_off1,
    lora_off2,
    lora_max_rank,
    lora_splits,
    stride_lora_split,
    stride_lora_bs,
    stride_lora_br,
    a_tiles,
    lora_rows,
    stride_lora_as,
    stride_lora_ar,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FIX_BF16: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LORA: tl.constexpr,
    LORA_R_PAD: tl.constexpr,
    LORA_S_PAD: tl.constexpr,
    LORA_GROUPS: tl.constexpr,
    LINE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile = pid_n  # this program's tile of W's rows
    if LORA == 2:  # the grid's first a_tiles tiles are the adapter's A rows (negative tile numbers)
        tile = pid_n - a_tiles
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w_ptrs = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn + (k_lo + kk)[None, :]
    if LORA == 2:
        if tile < 0:  # the shrink: rows of the row's adapter A over the same input (none without an adapter)
            slot = tl.load(lora_slot_ptr)
            if slot < 0:
                return
            a_rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), lora_rows - 1).to(tl.int64)
            w_ptrs = lora_a_ptr + slot.to(tl.int64) * stride_lora_as + a_rows[:, None] * stride_lora_ar
            w_ptrs += (k_lo + kk)[None, :]
    m_row = tl.minimum(m, M - 1)
    if USE_DOT:  # x^T tiles [BLOCK_K, M_PAD]
        x_offs = m_row[None, :] * stride_xm + kk[:, None]
        r_offs = m_row[None, :] * stride_rm + kk[:, None]
        acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    else:  # one row: tiles [BLOCK_K]
        x_offs = kk
        r_offs = kk
        acc_k = tl.zeros([BLOCK_N], tl.float32)

    if PROLOGUE == 2:  # the sum of squares of each row of h = x + residual, over the main loop's tiles
        sum_sq = tl.zeros([M_PAD] if USE_DOT else [BLOCK_K], tl.float32)
        writer = tile == 0  # these programs store h, the new residual
    x_offs += k_lo
    if LORA != 0:  # the adapter's B rows for the epilogue, loaded while the main loop runs
        lora_slot, lora_b, lora_ok = lora_row_b(
            lora_b_ptr, lora_slot_ptr, tile, n, N, lora_off1, lora_off2, lora_max_rank, stride_lora_bs,
            stride_lora_br, LORA_R_PAD, BLOCK_N,
        )  # fmt: skip
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        if EVEN_K:
            w = tl.load(w_ptrs)
            k_mask = None
        else:
            k_ok = k < K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            k_mask = k_ok[:, None] if USE_DOT else k_ok
        if PROLOGUE == 2:
            h = _load(x_ptr + x_offs, k_mask).to(tl.float32)
            if HAS_RESIDUAL:
                r = _load(res_ptr + r_offs + k0, k_mask).to(tl.float32)
                h = round_to(h + r, x_ptr.dtype.element_ty, FIX_BF16).to(tl.float32)  # as torch rounds x + r
                if USE_DOT:
                    tl.store(
                        res_out_ptr + m[None, :] * stride_rom + k[:, None],
                        h.to(res_out_ptr.dtype.element_ty),
                        mask=(k < K)[:, None] & (m < M)[None, :] & writer,
                    )
                else:
                    tl.store(res_out_ptr + k, h.to(res_out_ptr.dtype.element_ty), mask=(k < K) & writer)
            nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            if USE_DOT:
                sum_sq += tl.sum(h * h, axis=0)
                xt = round_to(h * nw[:, None], x_ptr.dtype.element_ty, FIX_BF16)
            else:
                sum_sq += h * h
                xt = round_to(h * nw, x_ptr.dtype.element_ty, FIX_BF16)
        else:
            xt = _input_tile(x_ptr, x_offs, k_mask, K, PROLOGUE, FIX_BF16)
        if USE_DOT:
            if UPCAST:
                w, xt = w.to(tl.float32), xt.to(tl.float32)
            elif W_SCALED:  # float8 weights: tensor cores take both operands in x's dtype
                w = w.to(xt.dtype)
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        else:
            acc_k += tl.sum(w.to(tl.float32) * xt.to(tl.float32)[None, :], axis=1)
        w_ptrs += BLOCK_K
        x_offs += BLOCK_K
    if not USE_DOT:
        acc = acc_k[:, None]  # [BLOCK_N, 1]
    if PROLOGUE == 2:  # W (h * weight) / rms = W (weight * rmsnorm(h))
        if USE_DOT:
            acc = acc * tl.math.rsqrt(sum_sq / K + eps)[None, :]
        else:
            acc = acc * tl.math.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)

    m_ok = (m < M)[None, :]
    if split_k > 1:
        # Partials [tiles, split_k, M_PAD, BLOCK_N] float32; only the M real rows are written and read.
        part_offs = m[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        tile_part = part_ptr + pid_n.to(tl.int64) * split_k * (M_PAD * BLOCK_N)
        tl.store(tile_part + pid_k * (M_PAD * BLOCK_N) + part_offs, acc, mask=m_ok)
        tl.debug_barrier()  # every thread's partials are issued before the release below
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") != split_k - 1:
            return
        acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
        for s in range(split_k):  # in split order: the same sum whichever split arrived last
            acc += tl.load(tile_part + s * (M_PAD * BLOCK_N) + part_offs, mask=m_ok, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + pid_n, 0)
    if LORA == 2:
        if tile < 0:  # publish these rows of the shrink's sums, then count the tile done
            r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(lora_part_ptr + r, tl.sum(acc, axis=1), mask=r < lora_rows)
            tl.debug_barrier()  # every thread's sums are issued before the release below
            grp = tl.arange(0, LORA_GROUPS)  # count this tile in every group that has weight tiles
            w_tiles = tl.num_programs(0) - a_tiles
            tl.atomic_add(lora_flag_ptr + grp * LINE, 1, mask=grp < w_tiles, sem="release", scope="gpu")
            return
    if W_SCALED:  # W = its float8 values times one scale per row, which factors out of the row's sums
        acc *= tl.load(ws_ptr + tl.minimum(n, N - 1))[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.minimum(n, N - 1)).to(tl.float32)[:, None]
    if LORA == 1:  # one row (the FMA path): + its adapter's delta on these columns, its sums also times 1 / rms
        sums = lora_row_sums(lora_part_ptr, lora_ok, lora_splits, stride_lora_split, LORA_R_PAD, LORA_S_PAD)
        delta = tl.sum(lora_b.to(tl.float32) * sums[:, None], axis=0)
        if PROLOGUE == 2:
            delta *= tl.math.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        acc += delta[:, None]
    if LORA == 2:  # + the delta from the A tiles' sums (already normed as these), once all of them are published
        if lora_slot >= 0:
            group = tile % LORA_GROUPS
            ready_ptr = lora_flag_ptr + group * LINE  # this group's ready count, its done count after it
            ready = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
            while ready < a_tiles:
                ready = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            sums = lora_row_sums(lora_part_ptr, lora_ok, 1, 0, LORA_R_PAD, 1)  # in flight during the count
            # the group's last W tile to pass its poll leaves its counters zeroed for the next call. Relaxed: a
            # tile counts itself only after its poll saw every A tile, and the zeros matter only to the next
            # call, which the kernel's end orders; the sums are overwritten only by that call's A tiles
            members = tl.cdiv(tl.num_programs(0) - a_tiles - group, LORA_GROUPS)
            if tl.atomic_add(ready_ptr + 1, 1, sem="relaxed", scope="gpu") == members - 1:
                tl.store(ready_ptr, 0)
                tl.store(ready_ptr + 1, 0)
            acc += tl.sum(lora_b.to(tl.float32) * sums[:, None], axis=0)[:, None]
    tl.store(
        out_ptr + m[None, :] * stride_om + n[:, None],
        round_to(acc, out_ptr.dtype.element_ty, FIX_BF16),
        mask=m_ok & (n < N)[:, None],
    )


@functools.cache
def default_config(m: int, n: int, k: int, elem_size: int, sms: int) -> GemvConfig:
    """The rule: M == 1 takes the FMA GEMV (16 rows x 1 KiB of K per tile), M > 1 the tensor-core one (64 rows
    x 256 B); split-K doubles while there are fewer than two programs per SM and each split keeps >= 2 tiles."""
    dot = m > 1
    block_n, block_k = (64, 256 // elem_size) if dot else (16, 1024 // elem_size)
    tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 2 * sms and k_tiles >= 4 * split:
        split *= 2
    return GemvConfig(block_n, block_k, split, num_warps=4, num_stages=4 if dot else 3, dot=dot)


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig:
    """The config for a weight of `dtype` (a float8 weight's tiles hold twice the columns of a 16-bit one's)."""
    tuned = CONFIGS.get((1 if m == 1 else MAX_M, n, k)) if dtype.itemsize == 2 else None
    return tuned or default_config(m, n, k, dtype.itemsize, num_sms(device))


def use_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None
) -> bool:
    """Whether `gemv` takes this product: CUDA, 1..16 rows of x (a row-strided 2-D view is fine), a
    contiguous 2-D weight and bias of x's dtype (bf16, fp16 or fp32), or a float8 weight with `weight_scale`
    (float32 [N, 1])."""
    k = x.shape[-1] if x.dim() else 0
    scaled = weight_scale is not None
    return (
        x.is_cuda
        and x.dtype in DTYPES
        and weight.dtype == (FP8 if scaled else x.dtype)
        and (
            not scaled
            or (
                weight_scale.dtype == torch.float32
                and weight_scale.shape == (weight.shape[0], 1)
                and weight_scale.is_contiguous()
            )
        )
        and weight.dim() == 2
        and weight.shape[1] == k > 0
        and weight.shape[0] > 0
        and weight.is_contiguous()
        and 1 <= x.numel() // k <= MAX_M
        and x.stride(-1) == 1
        and (x.dim() == 2 or x.is_contiguous())
        and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1] and bias.is_contiguous()))
    )


def make_workspace(partials: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K workspace: `partials` float32 partial sums (>= split_k * M_PAD * N rounded up to BLOCK_N) and
    `tiles` zeroed int32 arrival counters (>= ceil(N / BLOCK_N))."""
    return (
        torch.empty(partials, dtype=torch.float32, device=device),
        torch.zeros(tiles, dtype=torch.int32, device=device),
    )


_shared: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_outgrown: list[tuple[torch.Tensor, torch.Tensor]] = []  # kept alive: captured graphs may still use them


def _shared_workspace(partials: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ws = _shared.get(device)
    if ws is not None and ws[0].numel() >= partials and ws[1].numel() >= tiles:
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "gemv's split-K workspace would grow under CUDA-graph capture (its counters would be "
            "zeroed only by the graph): run the same shapes once eagerly before capturing"
        )
    if ws is not None:
        _outgrown.append(ws)
        partials, tiles = max(partials, ws[0].numel()), max(tiles, ws[1].numel())
    _shared[device] = ws = make_workspace(partials, tiles, device)
    return ws


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRADelta | LoRARows | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] with <= 16 rows (see `use_gemv`), in x's dtype. `out`
    [..., N] (contiguous) is written instead of a new tensor; `config` overrides `pick_config`; `workspace`
    (`make_workspace`) replaces the shared split-K workspace; `weight_scale` [N, 1]: the weight is float8
    and each row's sums are scaled by its scale; `lora`: plus its delta (for one row inside this kernel: the
    shrink's A rows as tiles of its own (`LoRARows`) or the shrink's sums (`LoRADelta`), B in the epilogue; else
    by its expand kernel after). No host sync; the grid is fixed by the shapes."""
    return _launch(x, weight, bias, out, config, workspace, weight_scale, lora=lora)


def gemv_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRADelta | LoRARows | None = None,
) -> torch.Tensor:
    """F.linear(silu(x[..., :K]) * x[..., K:], weight, bias): SwiGLU's activation and down projection in one
    kernel; x [..., 2K] with <= 16 rows, weight [N, K] (float8 with `weight_scale`, and `lora`, as `gemv`)."""
    return _launch(x, weight, bias, None, config, None, weight_scale, prologue=1, lora=lora)


def gemv_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRADelta | LoRARows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's RMSNorm (with the residual add) and the projection after it in one kernel:
    h = x + residual (x when residual is None), returns (F.linear(norm_weight * rmsnorm(h), weight, bias), h).
    x and residual [..., K] with <= 16 rows; norm_weight [K] of x's dtype; weight float8 with `weight_scale`,
    and `lora` (its shrink normed from the same h), as `gemv`."""
    assert norm_weight.shape == x.shape[-1:] and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
    norm = (norm_weight, eps)
    if residual is None:
        return _launch(x, weight, bias, None, config, None, weight_scale, prologue=2, norm=norm, lora=lora), x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = _launch(
        x,
        weight,
        bias,
        None,
        config,
        None,
        weight_scale,
        prologue=2,
        norm=norm,
        residual=(residual, residual_out),
        lora=lora,
    )
    return y, residual_out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    config: GemvConfig | None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
    weight_scale: torch.Tensor | None = None,
    prologue: int = 0,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora: LoRADelta | LoRARows | None = None,
) -> torch.Tensor:
    k = weight.shape[1]
    n = weight.shape[0]
    x_cols = 2 * k if prologue == 1 else k
    assert x.shape[-1] == x_cols, f"x has {x.shape[-1]} columns, the weight takes {x_cols}"
    x2 = x if x.dim() == 2 else x.reshape(-1, x_cols)
    m = x2.shape[0]
    assert 1 <= m <= MAX_M and x2.stride(-1) == 1 and weight.is_contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], n) and out.dtype == x.dtype and out.is_contiguous()
    if weight_scale is not None:
        assert weight.dtype == FP8 and weight_scale.dtype == torch.float32 and weight_scale.shape == (n, 1)
    else:
        assert weight.dtype == x.dtype
    cfg = config or pick_config(m, n, k, weight.dtype, x.device)
    if prologue == 2 and cfg.split_k > 1:  # its programs need all of K (the sum of squares)
        cfg = replace(cfg, split_k=1)
    assert cfg.dot or m == 1, "the FMA path takes one row"
    m_pad = 16 if cfg.dot else 1
    many_tiles = triton.cdiv(n, cfg.block_n) > LORA_ROWS_MAX_TILES
    if isinstance(lora, LoRARows) and (cfg.dot or weight_scale is not None or many_tiles):
        lora = lora.shrink()  # A rows only on the FMA path, of the weight's dtype: the shrink's kernel first
    if isinstance(lora, LoRARows):  # LoRA mode 2: the shrink's A rows as the grid's first tiles
        mode = 2
    else:  # 1: the shrink's sums in the epilogue of a one-row GEMV whose input is the shrink's (normed by both,
        # or neither); 0: none, or the expand kernel after
        mode = int(lora is not None and not cfg.dot and (lora.sum_sq is not None) == (prologue == 2))
    a_rows = lora.lora_a.shape[1] if mode == 2 else 0
    a_tiles, tiles = triton.cdiv(a_rows, cfg.block_n), triton.cdiv(n, cfg.block_n)
    k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    part, count = x2, x2  # placeholders, unused without split-K or mode 2
    need = (a_tiles + tiles) * cfg.split_k * m_pad * cfg.block_n if cfg.split_k > 1 else 0
    # mode 2 also keeps the A rows' sums [a_rows] and the groups' counters, from a line's start past the tiles'
    flags = triton.cdiv(a_tiles + tiles, LINE_INTS) * LINE_INTS
    counters = flags + LORA_GROUPS * LINE_INTS if mode == 2 else a_tiles + tiles
    if cfg.split_k > 1 or mode == 2:
        part, count = workspace or _shared_workspace(need + a_rows, counters, x.device)
        assert part.numel() >= need + a_rows and count.numel() >= counters
        assert part.dtype == torch.float32
    norm_weight, eps = norm if norm is not None else (x2, 0.0)
    res, res_out = (residual[0].reshape(-1, k), residual[1].view(-1, k)) if residual is not None else (x2, x2)
    lora_ptrs, lora_args, rows_args, r_pad, s_pad = (x2,) * 5, (0,) * 7, (0,) * 4, 1, 1
    if mode:
        lora_b = lora.lora_b
        assert lora_b.shape[2] == n and lora_b.dtype == x.dtype and lora_b.stride(-1) == 1
        r_pad = triton.next_power_of_2(lora_b.shape[1])
    if mode == 1:
        parts = lora.partials
        assert parts.shape[1] == 1
        lora_ptrs = (lora.token_slots, parts, lora_b, x2, x2)
        lora_args = (*lora.offsets, lora.max_rank, parts.shape[0], parts.stride(0), lora_b.stride(0), lora_b.stride(1))
        s_pad = triton.next_power_of_2(parts.shape[0])
    elif mode == 2:
        lora_a = lora.lora_a
        assert lora_a.dtype == weight.dtype and lora_a.shape[2] == k and lora_a.stride(-1) == 1
        lora_ptrs = (lora.token_slots, part[need:], lora_b, lora_a, count[flags:])
        lora_args = (*lora.offsets, lora.max_rank, 1, 0, lora_b.stride(0), lora_b.stride(1))
        rows_args = (a_tiles, a_rows, lora_a.stride(0), lora_a.stride(1))
    _gemv_kernel[(a_tiles + tiles, cfg.split_k)](
        x2,
        weight,
        weight_scale if weight_scale is not None else x2,
        bias if bias is not None else x2,
        out,
        part,
        count,
        res,
        norm_weight,
        res_out,
        *lora_ptrs,
        m,
        n,
        k,
        k_split,
        cfg.split_k,
        x2.stride(0),
        weight.stride(0),
        n,
        res.stride(0),
        res_out.stride(0),
        eps,
        *lora_args,
        *rows_args,
        M_PAD=m_pad,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        STAGES=cfg.num_stages,
        USE_DOT=cfg.dot,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None,
        W_SCALED=weight_scale is not None,
        UPCAST=cfg.dot and dot_upcast(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        FIX_BF16=fix_bf16(),
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        LORA=mode,
        LORA_R_PAD=r_pad,
        LORA_S_PAD=s_pad,
        LORA_GROUPS=LORA_GROUPS,
        LINE=LINE_INTS,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if lora is not None and not mode:
        lora.add_to_(out.view(-1, n))
    return out
