"""Tensor parallelism over the GPUs of one host: the process group and its two collectives."""

from heron.distributed.communication import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from heron.distributed.parallel_state import destroy_distributed, get_tp_rank, get_tp_world_size, init_distributed

__all__ = [
    "init_distributed",
    "destroy_distributed",
    "get_tp_rank",
    "get_tp_world_size",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_gather",
]
