"""Which BLAS library runs a projection's matmul on CUDA: cuBLAS or cuBLASLt, whichever ran it faster here.

PyTorch sends every matmul of a process to one library (cuBLAS unless told otherwise), and neither is the
faster at every shape: on an H200 cuBLASLt ran Qwen3-8B's projections from 6% slower to 14% faster than
cuBLAS at 32-256 rows, by matrix and row count (docs/perf_notes.md run 17). `tune` times both on the model's
own weights at the row counts the engine runs (its CUDA graphs' sizes and its step budget) and writes the
outcome on each weight; `linear` (heron/models/layers.py) asks `wants_lt` before a matmul and, where
cuBLASLt won, switches the library for that one call and restores the process's own preference after it, so
a user's own matmuls in the same process are left as they were. A row count between two tuned ones takes the
choice of the next one up, the size a captured step of that many rows runs padded to.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

PLAN_ATTR = "heron_cublaslt"  # on a weight: (tuned row counts ascending, cuBLASLt won at each)
ROTATE_MAX_ROWS = 512  # up to this many rows a matmul is timed over every layer's copy (past the L2 cache)
LARGE_COPIES = 4  # beyond it over a few copies: a compute-bound product does not care which one it reads
Timer = Callable[[list[torch.Tensor], torch.Tensor], tuple[float, float]]


def wants_lt(weight: torch.Tensor, rows: int) -> bool:
    """Whether `tune` found cuBLASLt faster for `rows` rows times this weight (False for untuned weights)."""
    plan = getattr(weight, PLAN_ATTR, None)
    if plan is None:
        return False
    tuned, lt = plan
    i = bisect.bisect_left(tuned, rows)
    return i < len(tuned) and lt[i]


def linear_lt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through cuBLASLt; the process's preferred library is restored after the call."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def time_on_gpu(weights: list[torch.Tensor], x: torch.Tensor, rounds: int = 2) -> tuple[float, float]:
    """(default, cuBLASLt) seconds of GPU time for x @ w.T over each of `weights` in turn, the best of `rounds`
    (the two in turn in each), by CUDA events; cuBLASLt's is inf where it refuses the shape or dtype. A sleep
    kernel holds the GPU while the host queues every call, so launch time is not counted."""
    calls = [F.linear]
    F.linear(x, weights[0])  # a first call may set up a library's handle or workspace
    try:
        linear_lt(x, weights[0])
        calls.append(linear_lt)
    except RuntimeError:  # no cuBLASLt kernel for this problem (e.g. unaligned rows): cuBLAS keeps it
        pass
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) * rounds + 1)]
    torch.cuda._sleep(20_000 * len(weights) * len(calls) * rounds)  # ~10 us a queued call at ~2 GHz
    events[0].record()
    for i in range(len(calls) * rounds):
        for w in weights:
            calls[i % len(calls)](x, w)
        events[i + 1].record()
    events[-1].synchronize()
    ms = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    best = [min(ms[j::len(calls)]) / 1e3 for j in range(len(calls))]
    return best[0], best[1] if len(best) > 1 else float("inf")


def tune(weights: Iterable[torch.Tensor], rows: list[int], timer: Timer = time_on_gpu) -> dict:
    """Times cuBLAS (the process's preference) against cuBLASLt for every distinct (shape, dtype) among
    `weights` (2-D, on CUDA) at each row count and writes the winner on every weight of that shape. Returns
    {(rows, N, K): (seconds default, seconds cuBLASLt)}, summed over the shape's weights, for the log."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for w in weights:
        groups[(tuple(w.shape), w.dtype)].append(w)
    rows = sorted(set(rows))
    found = {}
    with torch.inference_mode():
        for ((n, k), dtype), ws in groups.items():
            wins = []
            for m in rows:
                copies = ws if m <= ROTATE_MAX_ROWS else ws[:LARGE_COPIES]
                t_default, t_lt = timer(copies, torch.randn(m, k, dtype=dtype, device=ws[0].device))
                wins.append(t_lt < t_default)
                found[(m, n, k)] = (t_default * len(ws) / len(copies), t_lt * len(ws) / len(copies))
            plan = (tuple(rows), tuple(wins))
            for w in ws:
                setattr(w, PLAN_ATTR, plan)
    return found


def summary(found: dict, seconds: float) -> str:
    """One log line: where cuBLASLt won, and the matmul time of a step per row count with the choices made
    against cuBLAS alone (every weight once: all layers' projections and the LM head)."""
    per_rows: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (m, _, _), (t_default, t_lt) in found.items():
        per_rows[m][0] += t_default
        per_rows[m][1] += min(t_default, t_lt)
    lt = sum(t_lt < t for t, t_lt in found.values())
    steps = ", ".join(f"{m}: {a * 1e3:.2f} -> {b * 1e3:.2f}" for m, (a, b) in sorted(per_rows.items()))
    return (f"matmuls tuned in {seconds:.1f} s: cuBLASLt for {lt} of {len(found)} (rows, shape) pairs; "
            f"ms of matmuls per step by rows (cuBLAS -> chosen): {steps}")


def tune_and_summarise(weights: list[torch.Tensor], rows: list[int]) -> str:
    """`tune`, then `summary`'s line for the log."""
    start = time.perf_counter()
    found = tune(weights, rows)
    return summary(found, time.perf_counter() - start)
