"""The BLAS side of the matmul door on CUDA: cuBLAS (PyTorch's default), PyTorch's cuBLASLt, or one of
cuBLASLt's other candidates, as the weight's tuned `Plan` in the layer's registry says (plans.py; tune.py made it).

A row count between two tuned ones takes the library chosen at the next one up, the size a captured step of that
many rows runs padded to; a cuBLASLt candidate belongs to its exact problem, so it runs only at the row count it
was timed at (that of every captured decode graph). PyTorch sends every matmul of a process to one library and
has no per-call choice, and neither library is the faster at every shape, so where PyTorch's cuBLASLt is chosen
the library is switched for that one call and the process's preference restored after it (a user's own matmuls
in the same process are left as they were).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heron.kernels.gemm import cublaslt
from heron.kernels.gemm.cublaslt import Candidate
from heron.kernels.gemm.plans import MatmulPlans


def blas_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, plans: MatmulPlans | None = None
) -> torch.Tensor:
    """F.linear by the kernel tuned for this weight at this many rows (cuBLAS, F.linear, for a weight without a
    plan in `plans`)."""
    plan = plans.get(weight) if plans is not None else None
    if plan is not None:
        rows = x.numel() // x.shape[-1]
        cand = plan.candidate(rows)
        if cand is not None and bias is None:
            out = _run(cand, x, weight, x.dtype)
            if out is not None:
                return out
        if plan.wants_lt(rows):
            return linear_lt(x, weight, bias)
    return F.linear(x, weight, bias)


def mm_float32(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, plans: MatmulPlans | None = None
) -> torch.Tensor:
    """float32 x [m, k] @ weight [n, k].T from 16-bit operands, written into `out` if given: the tuned cuBLASLt
    candidate at its row count, else PyTorch's matmul with a float32 output."""
    plan = plans.get(weight, float32_out=True) if plans is not None else None
    cand = plan.candidate(x.shape[0]) if plan is not None else None
    if cand is not None:
        y = _run(cand, x, weight, torch.float32, out)
        if y is not None:
            return y
    return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)


def linear_lt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through PyTorch's cuBLASLt; the process's preferred library is restored after the call."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _run(
    cand: Candidate, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x @ weight.T by `cand` into `out` (allocated once the operands are checked, if None), or None (not run)
    where the matrices are not laid out as it was found for."""
    lt = cublaslt.handle(x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if lt is None or not lt.fits(x2, weight) or (out is not None and not lt.fits(out)):
        return None
    if out is None:
        out = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)
        if not lt.fits(out):  # a fresh block is 512-byte aligned: kept for the contract's sake
            return None
    lt.matmul(x2, weight, out.view(-1, out.shape[-1]), cand)
    return out
