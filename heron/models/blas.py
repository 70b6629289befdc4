"""Which BLAS kernel runs a projection's matmul on CUDA: cuBLAS's, cuBLASLt's first pick, or another of
cuBLASLt's candidates (heron/models/cublaslt.py), whichever ran it fastest here.

PyTorch sends every matmul of a process to one library (cuBLAS unless told otherwise), and neither is the
faster at every shape: on an H200 cuBLASLt ran Qwen3-8B's projections from 6% slower to 14% faster than
cuBLAS at 32-256 rows (docs/perf_notes.md run 17), and another of cuBLASLt's heuristic candidates beat both
by up to 10% on the projections and 16% on the LM head at some row counts (run 26). `tune` times them on the
model's own weights at the row counts the engine runs (its CUDA graphs' sizes and its step budget) and writes a
`Plan` on each weight; `linear` and `mm_float32` (the LM head's float32 logits) run the choice. A row count
between two tuned ones takes the library chosen at the next one up, the size a captured step of that many rows
runs padded to; a cuBLASLt candidate belongs to its exact problem, so it runs only at the row count it was
timed at (that of every captured decode graph). Where PyTorch's cuBLASLt is chosen, the library is switched
for that one call and the process's own preference restored after it, so a user's own matmuls in the same
process are left as they were.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heron.models.cublaslt import Candidate, CublasLt

PLAN_ATTR = "heron_blas"  # on a weight: its Plan for products in the weight's dtype (`linear`)
F32_PLAN_ATTR = "heron_blas_f32"  # on an LM head's weight: its Plan for float32 products (`mm_float32`)
ROTATE_BYTES = 256 << 20  # the weight copies a call is timed over in turn: several times the L2 cache (60 MB)
ROUNDS = 3
CANDIDATE_MARGIN = 0.99  # a candidate must beat both libraries by 1%: not a timing tie
MAX_REL_ERR = 2e-2  # a candidate's product against the library's, relative to its largest entry
Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Timer = Callable[[list[Call], list[torch.Tensor], torch.Tensor], list[float]]
_cublaslt: dict[int, CublasLt] = {}  # per device index, made by `tune`


@dataclass(frozen=True)
class Plan:
    """A weight's choices at the tuned row counts (ascending)."""

    rows: tuple[int, ...]
    lt: tuple[bool, ...]  # PyTorch's cuBLASLt beat cuBLAS (what row counts up to rows[i] take)
    exact: tuple[Candidate | None, ...]  # a cuBLASLt candidate that beat both at exactly rows[i]

    def wants_lt(self, rows: int) -> bool:
        i = bisect.bisect_left(self.rows, rows)
        return i < len(self.rows) and self.lt[i]

    def candidate(self, rows: int) -> Candidate | None:
        i = bisect.bisect_left(self.rows, rows)
        return self.exact[i] if i < len(self.rows) and self.rows[i] == rows else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear by the kernel `tune` chose for this weight at this many rows (F.linear for an untuned one)."""
    plan: Plan | None = getattr(weight, PLAN_ATTR, None)
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


def mm_float32(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 x [m, k] @ weight [n, k].T from 16-bit operands, written into `out` if given: the tuned cuBLASLt
    candidate at its row count, else PyTorch's matmul with a float32 output."""
    plan: Plan | None = getattr(weight, F32_PLAN_ATTR, None)
    cand = plan.candidate(x.shape[0]) if plan is not None else None
    if cand is not None:
        y = _run(cand, x, weight, torch.float32, out)
        if y is not None:
            return y
    return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)


def linear_lt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through cuBLASLt; the process's preferred library is restored after the call."""
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
    lt = _cublaslt.get(x.device.index)
    x2 = x.reshape(-1, x.shape[-1])
    if lt is None or not lt.fits(x2, weight) or (out is not None and not lt.fits(out)):
        return None
    if out is None:
        out = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)
        if not lt.fits(out):  # a fresh block is 512-byte aligned: kept for the contract's sake
            return None
    lt.matmul(x2, weight, out.view(-1, out.shape[-1]), cand)
    return out


def time_on_gpu(calls: list[Call], weights: list[torch.Tensor], x: torch.Tensor, rounds: int = ROUNDS) -> list[float]:
    """Seconds of GPU time of each call(x, w) over every one of `weights` in turn, the best of `rounds` (the
    calls in turn in each), by CUDA events; inf for a call that raises on its first try (a library without a
    kernel for the problem). A sleep kernel holds the GPU while the host queues every call, so launch time is
    not counted."""
    live = []
    for i, call in enumerate(calls):
        try:
            call(x, weights[0])  # a first call may set up a library's handle or workspace
            live.append(i)
        except RuntimeError:
            pass
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(live) * rounds + 1)]
    torch.cuda._sleep(40_000 * len(weights) * len(live) * rounds)  # ~20 us a queued call at ~2 GHz
    events[0].record()
    for r in range(rounds):
        for j, i in enumerate(live):
            for w in weights:
                calls[i](x, w)
            events[r * len(live) + j + 1].record()
    events[-1].synchronize()
    ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    best = [math.inf] * len(calls)
    for j, i in enumerate(live):
        best[i] = min(ms[j :: len(live)]) / 1e3
    return best


def _candidate_calls(
    lt: CublasLt | None, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, reference: torch.Tensor
) -> tuple[list[Candidate], list[Call]]:
    """cuBLASLt's candidates for this problem whose product agrees with `reference`, and a call for each."""
    if lt is None:
        return [], []
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if not lt.fits(x, weight, out):
        return [], []
    kept, calls = [], []
    scale = reference.float().abs().max().clamp_min(1e-30)
    for cand in lt.candidates(m, n, k, weight.dtype, out_dtype):
        try:
            out.fill_(math.nan)
            lt.matmul(x, weight, out, cand)
        except RuntimeError:
            continue
        if ((out.float() - reference.float()).abs().max() / scale).item() < MAX_REL_ERR:  # (NaN fails too)
            kept.append(cand)
            calls.append(_bind(lt, cand, out))
    return kept, calls


def _bind(lt: CublasLt, cand: Candidate, out: torch.Tensor) -> Call:
    return lambda x, w: lt.matmul(x, w, out, cand)


def _mm_float32_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, weight.t(), out_dtype=torch.float32)


def _copies(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fewest of a shape's copies (one per layer) whose bytes pass ROTATE_BYTES: each call then reads its
    weight from memory, as in a step, not from the L2 cache."""
    return ws[: max(1, min(len(ws), -(-ROTATE_BYTES // (ws[0].numel() * ws[0].element_size()))))]


def tune(
    weights: Iterable[torch.Tensor],
    rows: list[int],
    timer: Timer = time_on_gpu,
    float32_out: Iterable[torch.Tensor] = (),
) -> dict:
    """Times every kernel for every distinct (shape, dtype) among `weights` (2-D, on CUDA) at each row count and
    writes the `Plan` on every weight of that shape: cuBLAS and PyTorch's cuBLASLt for products in the weight's
    dtype, and for `float32_out` (an LM head whose logits are float32) PyTorch's float32-output matmul; each
    against cuBLASLt's other candidates where the device has cuBLASLt. Returns {(rows, N, K, out dtype):
    (seconds cuBLAS, seconds chosen, what was chosen)} summed over the shape's weights, for the log."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for w in weights:
        groups[(tuple(w.shape), w.dtype, False)].append(w)
    for w in float32_out:
        groups[(tuple(w.shape), w.dtype, True)].append(w)
    rows = sorted(set(rows))
    found = {}
    with torch.inference_mode():
        for ((n, k), dtype, to_float32), ws in groups.items():
            lt = _lt_for(ws[0].device)
            out_dtype = torch.float32 if to_float32 else dtype
            libs: list[Call] = [_mm_float32_torch] if to_float32 else [F.linear, linear_lt]
            lt_wins, exact = [], []
            copies = _copies(ws)
            for m in rows:
                x = torch.randn(m, k, dtype=dtype, device=ws[0].device)
                cands, cand_calls = _candidate_calls(lt, x, ws[0], out_dtype, libs[0](x, ws[0]))
                t = timer(libs + cand_calls, copies, x)
                t_lib = min(t[: len(libs)])
                best = min(range(len(t)), key=t.__getitem__)
                pick = cands[best - len(libs)] if best >= len(libs) and t[best] < CANDIDATE_MARGIN * t_lib else None
                lt_wins.append(len(libs) == 2 and t[1] < t[0])
                exact.append(pick)
                if pick is not None:
                    kind = "searched" if pick.rank < 0 else "candidate"  # searched: from cuBLASLt's table
                else:
                    kind = "cublaslt" if lt_wins[-1] else "cublas"
                chosen = t[best] if pick is not None else t_lib
                found[(m, n, k, out_dtype)] = (t[0] * len(ws) / len(copies), chosen * len(ws) / len(copies), kind)
            plan = Plan(tuple(rows), tuple(lt_wins), tuple(exact))
            for w in ws:
                setattr(w, F32_PLAN_ATTR if to_float32 else PLAN_ATTR, plan)
    return found


def _lt_for(device: torch.device) -> CublasLt | None:
    """The device's cuBLASLt (made once), or None off CUDA or where the library cannot be loaded."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cublaslt:
        try:
            _cublaslt[index] = CublasLt(torch.device("cuda", index))
        except OSError:
            return None
    return _cublaslt[index]


def summary(found: dict, seconds: float) -> str:
    """One log line: how often each kind of kernel won, and the matmul time of a step per row count with the
    choices made against cuBLAS alone (every tuned weight once: all layers' projections and the LM head)."""
    per_rows: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    kinds: dict[str, int] = defaultdict(int)
    for (m, *_), (t_default, t_chosen, kind) in found.items():
        per_rows[m][0] += t_default
        per_rows[m][1] += t_chosen
        kinds[kind] += 1
    steps = ", ".join(f"{m}: {a * 1e3:.2f} -> {b * 1e3:.2f}" for m, (a, b) in sorted(per_rows.items()))
    won = ", ".join(f"{kind} {kinds[kind]}" for kind in ("cublas", "cublaslt", "candidate", "searched"))
    return (
        f"matmuls tuned in {seconds:.1f} s over {len(found)} (rows, shape) pairs, chosen: {won}; "
        f"ms of matmuls per step by rows (cuBLAS -> chosen): {steps}"
    )


def tune_and_summarise(weights: list[torch.Tensor], rows: list[int], float32_out: list[torch.Tensor]) -> str:
    """`tune`, then `summary`'s line for the log."""
    start = time.perf_counter()
    found = tune(weights, rows, float32_out=float32_out)
    return summary(found, time.perf_counter() - start)
