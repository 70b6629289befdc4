"""The embedding and the LM head, split over the tensor-parallel ranks by contiguous vocabulary ranges (the same
split for both, which is what lets them stay tied)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from heron.distributed import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from heron.kernels.gemm.plans import plans_for_new_layer
from heron.layers.device_ops import DeviceOps
from heron.layers.linear import check_shape

MM_FLOAT32_OUT = "dtype_out" in torch.ops.aten.mm.overloads()  # torch.mm(..., out_dtype=) (recent PyTorch)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding on each rank. A token outside the range looks up zeros, and the
    all-reduce fills in each token from the rank that owns it. The vocabulary is padded to a multiple of the world
    size; the padded rows are zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.local_rows = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.local_rows
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(x)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        check_shape(loaded_weight, self.num_embeddings, param.shape[1])
        rows = loaded_weight[self.start : self.start + self.local_rows]
        param.data[: len(rows)].copy_(rows)
        param.data[len(rows) :].zero_()


class ParallelLMHead(VocabParallelEmbedding, DeviceOps):
    """The LM head with the embedding's split (so tying them is sharing one parameter): each rank scores its
    vocabulary range, and every rank gets the full logits, padding sliced off."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.matmul_plans = plans_for_new_layer()
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.weight.is_cuda:
            from heron.kernels.gemm.blas import mm_float32
            from heron.kernels.gemm.linear import linear
            from heron.kernels.gemv import use_gemv

            plans = self.matmul_plans
            self._linear, self._mm_float32 = partial(linear, plans=plans), partial(mm_float32, plans=plans)
            self._use_gemv = use_gemv
        else:
            self._linear, self._mm_float32, self._use_gemv = F.linear, None, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits)[..., : self.num_embeddings]

    def float32_matmul(self) -> bool:
        """Whether float_logits past the GEMV's rows is one matmul with a float32 output: at world size 1 on CUDA
        with 16-bit weights, where the running PyTorch has `torch.mm(..., out_dtype=)`."""
        w = self.weight
        return MM_FLOAT32_OUT and self.tp_size == 1 and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16)

    def float_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of hidden [T, H] (written into `out` if given). Where `float32_matmul`, past the GEMV's
        rows one matmul (the matmul door's `mm_float32`) writes float32 straight from 16-bit operands, instead of
        16-bit logits and a conversion pass over them (Qwen3-8B's head at 200 rows on an H200: 389 against
        488 us)."""
        if self.float32_matmul() and hidden.dtype == self.weight.dtype and not self._use_gemv(hidden, self.weight):
            return self._mm_float32(hidden, self.weight, out)
        logits = self(hidden)
        return logits.float() if out is None else out.copy_(logits)
