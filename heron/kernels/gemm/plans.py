"""The tuned matmul choices of a model's weights, and where the matmul door finds them.

A `Plan` is one weight's choices at the row counts the start-up tuner timed (tune.py). The model runner owns a
`MatmulPlans` registry, fills it by tuning and installs it with `use_plans`; `linear` / `mm_float32` look a
weight's plan up there on each call. Nothing is stored on the parameters, and a weight without a plan (tuning
off, the CPU, a weight made after tuning) takes the untuned path: the GEMV at decode sizes, else cuBLAS.
"""

from __future__ import annotations

import bisect
import weakref
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


_in_use = MatmulPlans()


def use_plans(plans: MatmulPlans) -> None:
    """Make `plans` the registry the matmul door reads (the model runner's, once it has built its model)."""
    global _in_use
    _in_use = plans


def plan_for(weight: torch.Tensor, float32_out: bool = False) -> Plan | None:
    """The installed registry's plan for `weight`, or None."""
    return _in_use.get(weight, float32_out)
