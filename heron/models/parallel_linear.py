"""Linear layers and embeddings split over the tensor-parallel ranks.

A transformer block needs one all-reduce per half: the layer that opens it (q/k/v, gate/up) is split
by output features, so each rank owns whole heads / whole MLP columns and needs nothing from the
others, and the layer that closes it (o, down) is split by input features, so each rank holds a
partial sum of the output. The vocabulary is split into contiguous ranges, for the embedding and
the LM head alike (which is what lets them stay tied).

Each layer's `weight_loader(param, loaded_weight, shard_id)` takes the full checkpoint tensor and
copies this rank's slice, so loaders never know about ranks. At world size 1 every forward is the
plain op of the layer it replaces (F.linear, F.embedding) with the same parameter names and shapes; the
matmuls go through `layers.linear` (F.linear, or the Triton GEMV for a decode batch on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.distributed import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from heron.models import blas
from heron.models.layers import linear, swiglu_linear

MM_FLOAT32_OUT = "dtype_out" in torch.ops.aten.mm.overloads()  # torch.mm(..., out_dtype=) (recent PyTorch)


def _divide(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size ({world_size}).")
    return size // world_size


def _check(loaded_weight: torch.Tensor, *full_shape: int) -> None:
    """Checkpoint tensors are checked against their full (unsplit) shape."""
    if tuple(loaded_weight.shape) != full_shape:
        raise ValueError(f"has shape {tuple(loaded_weight.shape)}, expected {full_shape}.")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
    """A parameter every rank holds whole (norms)."""
    _check(loaded_weight, *param.shape)
    param.data.copy_(loaded_weight)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split over ranks; returns this rank's columns of y.

    `output_sizes` lists the full sizes of the matrices fused into one (q, k, v or gate, up): each is
    split on its own, so a rank holds [its q | its k | its v], the layout the model's split expects.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.output_sizes = output_sizes
        self.local_sizes = [_divide(s, self.tp_size, "output size") for s in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size))
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        """`loaded_weight`: the full matrix (or bias) of fused part `shard_id` (None: the only part)."""
        shard_id = shard_id or 0
        _check(loaded_weight, self.output_sizes[shard_id], *param.shape[1:])
        size = self.local_sizes[shard_id]
        dst = param.data.narrow(0, sum(self.local_sizes[:shard_id]), size)
        dst.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split over ranks: x arrives already split (the
    output of a ColumnParallelLinear), each rank's product is a partial sum, one all-reduce adds them,
    and the bias is added once after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.local_input = _divide(input_size, self.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """swiglu: x is this rank's [gate | up] of a gate/up projection, and silu(gate) * up is the input
        (taken inside the matmul at decode sizes: `swiglu_linear`)."""
        matmul = swiglu_linear if swiglu else linear
        if self.tp_size == 1:
            return matmul(x, self.weight, self.bias)
        y = tensor_model_parallel_all_reduce(matmul(x, self.weight))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if param is self.bias:
            return default_weight_loader(param, loaded_weight)
        _check(loaded_weight, self.output_size, self.input_size)
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * self.local_input, self.local_input))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding on each rank. A token outside the range looks up zeros, and
    the all-reduce fills in each token from the rank that owns it. The vocabulary is padded to a
    multiple of the world size; the padded rows are zeros."""

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
        _check(loaded_weight, self.num_embeddings, param.shape[1])
        rows = loaded_weight[self.start : self.start + self.local_rows]
        param.data[: len(rows)].copy_(rows)
        param.data[len(rows) :].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head with the embedding's split (so tying them is sharing one parameter): each rank
    scores its vocabulary range, and every rank gets the full logits, padding sliced off."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits)[..., : self.num_embeddings]

    def float32_matmul(self) -> bool:
        """Whether float_logits past the GEMV's rows is one matmul with a float32 output: at world size 1 on
        CUDA with 16-bit weights, where the running PyTorch has `torch.mm(..., out_dtype=)`."""
        w = self.weight
        return MM_FLOAT32_OUT and self.tp_size == 1 and w.is_cuda and w.dtype in (torch.bfloat16, torch.float16)

    def float_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of hidden [T, H] (written into `out` if given). Where `float32_matmul`, past the GEMV's
        rows one matmul (heron/models/blas.py's choice) writes float32 straight from 16-bit operands, instead of
        16-bit logits and a conversion pass over them (Qwen3-8B's head at 200 rows on an H200: 389 against
        488 us)."""
        if self.float32_matmul() and hidden.dtype == self.weight.dtype:
            from heron.kernels.gemv import use_gemv

            if not use_gemv(hidden, self.weight):
                return blas.mm_float32(hidden, self.weight, out)
        logits = self(hidden)
        return logits.float() if out is None else out.copy_(logits)
