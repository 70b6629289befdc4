"""The start-up tuner: which BLAS kernel runs each projection's matmul on CUDA past the GEMV's rows, timed on
the model's own weights.

PyTorch sends every matmul of a process to one library (cuBLAS unless told otherwise), and neither is the
faster at every shape: on an H200 cuBLASLt ran Qwen3-8B's projections from 6% slower to 14% faster than
cuBLAS at 32-256 rows (docs/history/perf_notes.md run 17), and another of cuBLASLt's heuristic candidates beat both
by up to 10% on the projections and 16% on the LM head at some row counts (run 26). `tune` times them at the
row counts the engine runs (its CUDA graphs' sizes and its step budget) and records a `Plan` per weight in the
model runner's `MatmulPlans`; blas.py's `blas_linear` and `mm_float32` (the LM head's float32 logits) run the
choice. The search for configurations beyond the heuristic's (benchmarks/cublaslt_probe.py) feeds the per-GPU
table cublaslt_table.json, whose entry joins a problem's candidates here.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from heron.kernels.gemm import cublaslt
from heron.kernels.gemm.blas import linear_lt
from heron.kernels.gemm.cublaslt import Candidate, CublasLt
from heron.kernels.gemm.fp8 import FP8_DTYPE
from heron.kernels.gemm.plans import MatmulPlans, Plan

ROTATE_BYTES = 256 << 20  # the weight copies a call is timed over in turn: several times the L2 cache (60 MB)
ROUNDS = 3
CANDIDATE_MARGIN = 0.99  # a candidate must beat both libraries by 1%: not a timing tie
MAX_REL_ERR = 2e-2  # a candidate's product against the library's, relative to its largest entry
Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Timer = Callable[[list[Call], list[torch.Tensor], torch.Tensor], list[float]]


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
    plans: MatmulPlans,
    weights: Iterable[torch.Tensor],
    rows: list[int],
    timer: Timer = time_on_gpu,
    float32_out: Iterable[torch.Tensor] = (),
) -> dict:
    """Times every kernel for every distinct (shape, dtype) among `weights` (2-D, on CUDA) at each row count and
    records the `Plan` of every weight of that shape in `plans`: cuBLAS and PyTorch's cuBLASLt for products in the
    weight's dtype, and for `float32_out` (an LM head whose logits are float32) PyTorch's float32-output matmul; each
    against cuBLASLt's other candidates where the device has cuBLASLt. Returns {(rows, N, K, out dtype):
    (seconds cuBLAS, seconds chosen, what was chosen)} summed over the shape's weights, for the log."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for w in weights:
        if w.dtype not in (FP8_DTYPE, torch.int32):  # FP8 (fp8.py) and int4 (int4.py) weights have no choices here
            groups[(tuple(w.shape), w.dtype, False)].append(w)
    for w in float32_out:
        groups[(tuple(w.shape), w.dtype, True)].append(w)
    rows = sorted(set(rows))
    found = {}
    with torch.inference_mode():
        for ((n, k), dtype, to_float32), ws in groups.items():
            lt = cublaslt.handle(ws[0].device)
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
                plans.set(w, plan, float32_out=to_float32)
    return found


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


def tune_and_summarise(
    plans: MatmulPlans, weights: list[torch.Tensor], rows: list[int], float32_out: list[torch.Tensor]
) -> str:
    """`tune` into `plans`, then `summary`'s line for the log."""
    start = time.perf_counter()
    found = tune(plans, weights, rows, float32_out=float32_out)
    return summary(found, time.perf_counter() - start)
