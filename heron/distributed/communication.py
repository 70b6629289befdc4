"""The collectives of tensor parallelism; both return their input untouched at world size 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from heron.distributed.parallel_state import get_tp_world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place."""
    if get_tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """[..., N] on each rank -> [..., world_size * N], rank r's piece at columns r*N:(r+1)*N."""
    world_size = get_tp_world_size()
    if world_size == 1:
        return x
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(pieces, x)
    return torch.cat(pieces, dim=-1)
