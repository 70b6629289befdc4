"""Draw one token per row from logits in one pass over the vocabulary: no [R, V] temporaries.

The function computed is the sampler's (`heron.executor.sampler.sample_tokens_torch` is its PyTorch
reference):

- greedy rows (temperature 0): the argmax of the logits;
- other rows: the argmax over kept tokens (logit >= the row's threshold; NaN is never kept) of
  `logit * (1 / T) + g`, with Gumbel noise `g = -log(E)`, `E = -log(1 - w)` ~ Exp(1), `w` from 52 bits of
  splitmix64(seed, counter, token) in uint64 arithmetic (`heron.executor.sampler.gumbel_noise`). This is the
  exponential race argmax(p / E) in log space: no softmax. All float32; `-log(1 - w)` is Goldberg's log1p
  `log(z) * w / (z - 1)`, z = 1 - w (accurate for small w, where the race's winners are), divisions are
  correctly rounded (div_rn), logs are libdevice's (CUDA's logf, as torch's) and FMA contraction is off,
  so on a GPU every value equals PyTorch's bit for bit (tested); under the interpreter numpy's log may
  differ from torch's CPU one in the last bit.
- ties: the lowest token id wins (also when every score is -inf: token 0).

Grid `(R, S)`: program `(r, s)` scans split `s` (whole tiles of BLOCK tokens) of row `r`, keeping its best
score and token; with S > 1 a second kernel `(R,)` reduces the S partials (first split wins ties, and
splits are in token order, so the lowest id still wins). S is chosen from (R, V, #SMs) so that small
batches still fill the GPU. A sampled row's scan keeps the best score and token per lane (strict `>`: a
lane keeps its lowest token on ties; NaN and -inf never replace anything) and reduces across lanes once per
split (the max, then the lowest token id holding it), not per tile; its hash input `key + token * golden`
is a per-tile scalar plus a per-lane vector computed once (uint64 wraps: the same sum). With thresholds,
tiles whose tokens are all below the row's threshold skip the hash and logs (one reduction per tile);
without, no tile can be skipped and none is tested. Greedy rows reduce each tile (tl.max / tl.argmax).
A score is NaN only if the logit is (never kept) or for T = +inf or T < ~3e-39 (0 * inf); such a token is
never drawn here, where torch's argmax would pick it.

`row_logsumexp` (one pass, online max / sum) is the top-p normaliser used by the thresholds on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from heron.kernels.common import interpreting, num_sms, pdl_enter, pdl_options


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """Full-precision log (libdevice, as torch's CUDA log; tl.log may lower to an approximation). The
    interpreter has no libdevice: numpy's log there."""
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _mix64(x):
    """splitmix64's finaliser on uint64 (wrapping multiplies, logical shifts)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _greedy_scan(row_ptr, V, tile0, tile1, BLOCK: tl.constexpr):
    best = -float("inf")
    best_idx = tile0 * BLOCK
    for tile in range(tile0, tile1):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.argmax(x, 0)  # lowest index among ties
        better = m > best  # strict: an earlier tile wins ties
        best_idx = tl.where(better, tile * BLOCK + i, best_idx)
        best = tl.where(better, m, best)
    return best, best_idx


@triton.jit
def _gumbel(x, LIBDEVICE: tl.constexpr):
    """Gumbel noise -log(-log(1 - w)) (float32) of hash inputs x = key + token * golden (uint64, wrapping): see
    heron.executor.sampler.gumbel_noise. The caller forms x so that a scan adds one vector per tile."""
    h = _mix64(x)
    w = ((h >> 12).to(tl.float32) + 0.5) * 2.220446049250313e-16  # 52 bits -> (0, 1]: 2^-52 is exact
    w = tl.minimum(w, 0.99999994039535522)  # 1 - 2^-24: w < 1
    z = 1.0 - w
    one = z == 1.0  # w < 2^-25: -log1p(-w) rounds to w
    e = tl.where(one, w, tl.math.div_rn(_log(z, LIBDEVICE) * w, tl.where(one, -1.0, z - 1.0)))  # -log1p(-w)
    return -_log(e, LIBDEVICE)


@triton.jit
def _lane_update(score, offs, best, best_idx):
    """Per-lane running best: strict `>`, so a lane keeps its earliest (lowest) token on ties, and NaN (or
    -inf) never replaces anything."""
    better = score > best
    return tl.where(better, score, best), tl.where(better, offs, best_idx)


@triton.jit
def _first_max(best, best_idx, V):
    """(max, lowest token id attaining it) over the lanes; all -inf: every lane still holds the split's first
    token."""
    m = tl.max(best, 0)
    return m, tl.min(tl.where(best == m, best_idx, V), 0)


@triton.jit
def _sampled_scan(
    row_ptr, V, tile0, tile1, inv_t, thr, key, HAS_THR: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    """(best score, lowest token holding it) over tiles [tile0, tile1) of a sampled row: per-lane bests, one
    cross-lane reduction at the end (see the module docstring)."""
    lanes = tl.arange(0, BLOCK)
    lane_key = lanes.to(tl.uint64) * 0x9E3779B97F4A7C15  # token * golden = tile part + this (mod 2^64)
    best = tl.full([BLOCK], -float("inf"), tl.float32)
    best_idx = tl.full([BLOCK], tile0 * BLOCK, tl.int32)  # what an all -inf split returns
    for tile in range(tile0, tile1):
        offs = tile * BLOCK + lanes
        x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        tile_key = key + tl.cast(tile * BLOCK, tl.uint64) * 0x9E3779B97F4A7C15
        if HAS_THR:
            keep = x >= thr  # NaN never kept; masked lanes (-inf) score -inf or NaN: never better
            if tl.max(keep.to(tl.int32), 0) > 0:  # else nothing in this tile can be drawn
                g = _gumbel(tile_key + lane_key, LIBDEVICE)
                score = tl.where(keep, x * inv_t + g, -float("inf"))  # no FMA: enable_fp_fusion=False
                best, best_idx = _lane_update(score, offs, best, best_idx)
        else:  # a NaN logit scores NaN, which, like -inf, is never better
            best, best_idx = _lane_update(x * inv_t + _gumbel(tile_key + lane_key, LIBDEVICE), offs, best, best_idx)
    return _first_max(best, best_idx, V)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_r,
    temp_ptr,
    thr_ptr,
    seed_ptr,
    ctr_ptr,
    part_best_ptr,
    part_idx_ptr,
    out_ptr,
    V,
    tiles_per_split,
    HAS_THR: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    num_tiles = tl.cdiv(V, BLOCK)
    tile0 = s * tiles_per_split
    tile1 = tl.minimum(tile0 + tiles_per_split, num_tiles)
    row_ptr = logits_ptr + r.to(tl.int64) * stride_r
    temp = tl.load(temp_ptr + r).to(tl.float32)
    if temp > 0:
        if HAS_THR:
            thr = tl.load(thr_ptr + r).to(tl.float32)
        else:
            thr = -float("inf")
        seed = tl.load(seed_ptr + r).to(tl.uint64, bitcast=True)
        ctr = tl.load(ctr_ptr + r).to(tl.uint64, bitcast=True)
        key = _mix64(_mix64(seed) + ctr * 0x9E3779B97F4A7C15)
        inv_t = tl.math.div_rn(1.0, temp)  # correctly rounded, as torch's 1 / T
        best, best_idx = _sampled_scan(row_ptr, V, tile0, tile1, inv_t, thr, key, HAS_THR, BLOCK, LIBDEVICE)
    else:
        best, best_idx = _greedy_scan(row_ptr, V, tile0, tile1, BLOCK)
    if SPLIT:
        n = tl.num_programs(1)
        tl.store(part_best_ptr + r * n + s, best)
        tl.store(part_idx_ptr + r * n + s, best_idx)
    else:
        tl.store(out_ptr + r, best_idx.to(tl.int64))


@triton.jit
def _reduce_kernel(part_best_ptr, part_idx_ptr, out_ptr, S, S_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0)
    s = tl.arange(0, S_PAD)
    b = tl.load(part_best_ptr + r * S + s, mask=s < S, other=-float("inf"))
    i = tl.argmax(b, 0)  # the first split among ties: the lowest token id
    tok = tl.load(part_idx_ptr + r * S + i)
    tl.store(out_ptr + r, tok.to(tl.int64))


def default_plan(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(block, num_splits): about 4 programs per SM, each scanning whole tiles of `block` tokens."""
    block = min(1024, max(16, triton.next_power_of_2(vocab)))
    tiles = triton.cdiv(vocab, block)
    splits = max(1, min(tiles, triton.cdiv(4 * num_sms(device), max(rows, 1)), 256))
    return block, splits


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    thresholds: torch.Tensor | None,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    *,
    block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """logits [R, V] (float32 / bfloat16 / float16; last dim contiguous), temperature [R] (0 = greedy),
    thresholds [R] float32 or None (no row masks), seeds / counters [R] int64 -> token ids [R] int64.
    Thresholds apply to the raw logits: a sampled row draws only among tokens with logit >= threshold."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [R, V] with a contiguous last dim"
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    d_block, d_splits = default_plan(rows, vocab, logits.device)
    block = block or d_block
    assert block & (block - 1) == 0, "block must be a power of two"
    tiles = triton.cdiv(vocab, block)
    splits = max(1, min(num_splits or d_splits, tiles))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # no empty splits
    temperature = temperature.to(torch.float32).contiguous()
    seeds, counters = seeds.to(torch.int64).contiguous(), counters.to(torch.int64).contiguous()
    thr = thresholds.to(torch.float32).contiguous() if thresholds is not None else temperature  # unread
    if splits > 1:
        part_best = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    else:
        part_best = part_idx = out  # unread
    interp = interpreting()
    extra = {} if interp else {"enable_fp_fusion": False}  # bit-for-bit torch: no a * b + c -> fma
    pdl = pdl_options(logits.device, rows)
    _sample_kernel[(rows, splits)](
        logits,
        logits.stride(0),
        temperature,
        thr,
        seeds,
        counters,
        part_best,
        part_idx,
        out,
        vocab,
        tiles_per_split,
        HAS_THR=thresholds is not None,
        SPLIT=splits > 1,
        BLOCK=block,
        LIBDEVICE=not interp,
        num_warps=num_warps,
        **extra,
        **pdl,
    )
    if splits > 1:
        _reduce_kernel[(rows,)](
            part_best, part_idx, out, splits, S_PAD=triton.next_power_of_2(splits), num_warps=1, **pdl
        )
    return out


@triton.jit
def _logsumexp_kernel(x_ptr, stride_r, inv_t_ptr, out_ptr, V, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0)
    row_ptr = x_ptr + r.to(tl.int64) * stride_r
    inv_t = tl.load(inv_t_ptr + r).to(tl.float32)
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32) * inv_t
        new_m = tl.maximum(m, tl.max(x, 0))
        safe = tl.where(new_m == -float("inf"), 0.0, new_m)  # all -inf so far: no inf - inf
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), 0)
        m = new_m
    tl.store(out_ptr + r, m + tl.log(s))


def row_logsumexp(x: torch.Tensor, inv_t: torch.Tensor, *, block: int = 8192, num_warps: int = 8) -> torch.Tensor:
    """[R] float32 logsumexp over each row of x [R, V] * inv_t [R] in one pass (no [R, V] temporary); the
    normaliser of top-p. Within float32 rounding of torch.logsumexp(x * inv_t[:, None], -1)."""
    assert x.dim() == 2 and x.stride(1) == 1
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = min(block, max(16, triton.next_power_of_2(vocab)))
        _logsumexp_kernel[(rows,)](
            x,
            x.stride(0),
            inv_t.to(torch.float32).contiguous(),
            out,
            vocab,
            BLOCK=block,
            num_warps=num_warps,
            **pdl_options(x.device, rows),
        )
    return out
