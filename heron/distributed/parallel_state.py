"""Which tensor-parallel rank this process is, out of how many.

One worker process per rank, all ranks of one host in the default process group. Until
`init_distributed` is called the answers are rank 0 of 1, so single-process code never touches
torch.distributed. Models read them once, when their layers are built.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_rank, _world_size = 0, 1


def init_distributed(
    rank: int, world_size: int, init_method: str, backend: str | None = None, timeout: timedelta | None = None
) -> None:
    """Join the group (`init_method`: "tcp://127.0.0.1:PORT" or "file:///path"). `backend`: NCCL when
    CUDA is available, else gloo. With NCCL the process takes GPU `rank` (one host: rank = local GPU).
    `timeout`: how long a collective may wait for the other ranks (None: torch's default)."""
    global _rank, _world_size
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    _rank, _world_size = rank, world_size


def destroy_distributed() -> None:
    global _rank, _world_size
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _world_size = 0, 1


def get_tp_rank() -> int:
    return _rank


def get_tp_world_size() -> int:
    return _world_size
