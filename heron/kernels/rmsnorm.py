"""RMSNorm, optionally fused with the residual add of the pre-norm block, in one kernel.

One program normalises ROWS rows (one row for hidden sizes >= 1024, up to 16 for small ones) held whole in
registers (hidden sizes up to 8192). The grid is (ceil(rows / ROWS),), fixed by the tensor shape, with no host
sync, so it can be captured in a CUDA graph.

Rounding follows the model's PyTorch code exactly (`heron.kernels.reference.rms_norm_ref`, which is what
runs on CPU): x + residual is summed in float32 and rounded to x's dtype (that rounded value is both the
new residual and what is normalised); the normalised row is computed in float32, rounded to x's dtype, then
multiplied by the weight in float32 and rounded once to the output dtype (`weight * h.to(dtype)`, the type
promotion of weight and x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.common import interpreting, pdl_enter, pdl_options

MAX_HIDDEN = 8192


@triton.jit
def round_to(x, dtype: tl.constexpr, FIX_BF16: tl.constexpr):
    """float32 `x` -> `dtype`, rounded to nearest even like torch's `.to(dtype)`. FIX_BF16 (set only under
    the interpreter, see `fix_bf16()`): round to bfloat16 on the bits first, since Triton 3.6's interpreter
    truncates float32 -> bfloat16 (its cast ignores the rounding mode). On a GPU it is one cvt.rn."""
    if FIX_BF16 and dtype == tl.bfloat16:
        u = x.to(tl.int32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & -65536  # RTNE on the upper 16 bits (finite values)
        x = u.to(tl.float32, bitcast=True)
    return x.to(dtype)


def fix_bf16() -> bool:
    """Whether kernels must round float32 -> bfloat16 themselves (`round_to`): only under the interpreter."""
    return interpreting()


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    FIX_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    h = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = round_to(h + r, x_ptr.dtype.element_ty, FIX_BF16)  # x + residual, rounded as torch rounds it
        tl.store(res_out_ptr + r64 * stride_ro + cols[None, :], s, mask=mask)
        h = s.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=1) / n_cols
    h = h * tl.math.rsqrt(mean_sq + eps)[:, None]
    h = round_to(h, x_ptr.dtype.element_ty, FIX_BF16).to(tl.float32)  # h.to(dtype)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + r64 * stride_o + cols[None, :],
        round_to(h * w[None, :], out_ptr.dtype.element_ty, FIX_BF16),
        mask=mask,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> a [rows, N] view with a contiguous last dim (a copy only if no such view exists)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _launch(x, residual, weight, eps, out, residual_out):
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} for hidden size {n}"
    assert n <= MAX_HIDDEN, f"hidden size {n} > {MAX_HIDDEN} (one row must fit one program)"
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype, "out must have x's shape and the promoted dtype"
    x2, o2 = _rows(x), out.view(-1, n)
    r2 = ro2 = x2  # placeholders (not read or written) without a residual
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype"
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype
        r2, ro2 = _rows(residual), residual_out.view(-1, n)
    rows = x2.shape[0]
    if rows > 0:
        block_n = triton.next_power_of_2(n)
        per_prog = max(1, min(16, 1024 // block_n))
        elems = per_prog * block_n
        _rms_norm_kernel[(triton.cdiv(rows, per_prog),)](
            x2,
            r2,
            weight,
            o2,
            ro2,
            rows,
            n,
            x2.stride(0),
            r2.stride(0),
            o2.stride(0),
            ro2.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=block_n,
            ROWS=per_prog,
            FIX_BF16=fix_bf16(),
            num_warps=4 if elems <= 2048 else 8 if elems <= 4096 else 16,
            **pdl_options(x.device, rows),
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., N] (last dim contiguous), weight [N] -> weight * rmsnorm(x), in the promoted dtype of weight and x.
    `out` (contiguous, may be x itself) is written instead of a new tensor."""
    return _launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
):
    """(x + residual) -> (weight * rmsnorm(x + residual), x + residual) in one kernel; x and residual [..., N]
    of one dtype. `out` / `residual_out` (contiguous; residual_out may be `residual` itself, out may be x) are
    written instead of new tensors."""
    return _launch(x, residual, weight, eps, out, residual_out)
