"""The collectives at world size 1 (untouched inputs, no process group) and across two gloo ranks."""

from __future__ import annotations

import torch

from heron.distributed import (
    destroy_distributed,
    get_tp_rank,
    get_tp_world_size,
    init_distributed,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def test_without_a_group_this_is_rank_0_of_1_and_collectives_return_their_input():
    x = torch.randn(3, 4)
    assert (get_tp_rank(), get_tp_world_size()) == (0, 1)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x


def _collectives(rank: int, world_size: int, init_method: str) -> None:
    init_distributed(rank, world_size, init_method, "gloo")
    try:
        assert (get_tp_rank(), get_tp_world_size()) == (rank, world_size)
        x = torch.full((3, 2), float(rank + 1))
        assert torch.equal(tensor_model_parallel_all_reduce(x), torch.full((3, 2), 3.0))
        piece = torch.arange(6.0).view(2, 3) + 10 * rank
        gathered = tensor_model_parallel_all_gather(piece)
        assert torch.equal(gathered, torch.cat([torch.arange(6.0).view(2, 3) + 10 * r for r in range(world_size)], -1))
    finally:
        destroy_distributed()
    assert (get_tp_rank(), get_tp_world_size()) == (0, 1)


def test_all_reduce_sums_and_all_gather_concatenates_the_last_dim_across_two_ranks(spawn_ranks):
    spawn_ranks(_collectives)
