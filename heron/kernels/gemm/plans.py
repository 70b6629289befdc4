"""The tuned matmul choices of a model's weights, and how a model's layers find them.

A `Plan` is one weight's choices at the row counts the start-up tuner timed (tune.py). Each model runner owns a
`MatmulPlans` registry and builds its model inside `use_plans(registry)`: every projection layer takes the
registry in force when it is built and hands it to the matmul door on each call, and the runner fills it when it
tunes. So two engines in one process keep their own plans, nothing is stored on the parameters, and a weight
without a plan (tuning off, the CPU, a layer built outside a runner) takes the untuned path: the GEMV at decode
sizes, else cuBLAS.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from heron.kernels.gemm.cublaslt import Candidate


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


class MatmulPlans:
    """Plans by weight: one for products in the weight's dtype (`linear`) and one for float32 products
    (`mm_float32`, an LM head's logits). A weight is found by identity, held weakly: the registry keeps no
    weight alive, and a freed weight's entry can never be taken by a new tensor at the same address."""

    def __init__(self) -> None:
        self._by_id: tuple[dict[int, tuple[weakref.ref, Plan]], ...] = ({}, {})  # [float32_out]

    def set(self, weight: torch.Tensor, plan: Plan, float32_out: bool = False) -> None:
        self._by_id[float32_out][id(weight)] = (weakref.ref(weight), plan)

    def get(self, weight: torch.Tensor, float32_out: bool = False) -> Plan | None:
        entry = self._by_id[float32_out].get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None

    def __len__(self) -> int:
        return sum(map(len, self._by_id))


_UNTUNED = MatmulPlans()  # what layers built outside `use_plans` take; never filled
_building: list[MatmulPlans] = []


@contextmanager
def use_plans(plans: MatmulPlans) -> Iterator[None]:
    """Layers built inside take their matmul plans from `plans` (the model runner's)."""
    _building.append(plans)
    try:
        yield
    finally:
        _building.pop()


def plans_for_new_layer() -> MatmulPlans:
    """The registry a projection layer built now keeps: the innermost `use_plans`'s, else an empty one."""
    return _building[-1] if _building else _UNTUNED
