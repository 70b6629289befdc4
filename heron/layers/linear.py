"""Linear layers split over the tensor-parallel ranks.

A transformer block needs one all-reduce per half: the layer that opens it (q/k/v, gate/up) is split by output
features, so each rank owns whole heads / whole MLP columns and needs nothing from the others, and the layer that
closes it (o, down) is split by input features, so each rank holds a partial sum of the output.

Each layer's `weight_loader(param, loaded_weight, shard_id)` takes the full checkpoint tensor and copies this
rank's slice, so loaders never know about ranks. At world size 1 every forward is the plain op of the layer it
replaces (F.linear) with the same parameter names and shapes: on CUDA through the matmul door
(heron/kernels/gemm/linear.py: the GEMV at decode sizes, else the BLAS kernel tuned for the weight in the
`MatmulPlans` registry the layer was built with), F.linear elsewhere.

`use_fp8()` turns a layer's weight into float8 e4m3 with a float32 scale per output row (`weight_scale`, loaded
under the checkpoint's name; a per-tensor scale is stored on every row of its matrix), which the layer passes to
the door's entry points with the weight (the GEMV at decode sizes, else heron/kernels/gemm/fp8.py; its
dequantize-then-matmul reference off CUDA). `use_int4(group_size,
zero_point)` holds it packed in int4 (int32 `weight` [N, K/8], `weight_scale` [N, K/G], `weight_zero_point`
[N, K/G] where the format has zero points; heron/kernels/gemm/int4.py says the layout) and runs the door's W4A16
GEMM. Both layouts keep rows as output features, so the loaders below split and fuse them as they do a 16-bit
weight; a row-parallel layer's columns split by whole groups.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from heron.distributed import get_tp_rank, get_tp_world_size, tensor_model_parallel_all_reduce
from heron.kernels.gemm.fp8 import FP8_DTYPE
from heron.kernels.gemm.plans import plans_for_new_layer
from heron.kernels.reference import (
    fp8_linear_ref,
    gelu_tanh_and_mul_ref,
    gelu_tanh_mul_linear_ref,
    int4_linear_ref,
    silu_and_mul_ref,
    silu_mul_linear_ref,
)
from heron.layers.device_ops import DeviceOps

if TYPE_CHECKING:
    from heron.kernels.lora import LoRAWeights


def divide(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size ({world_size}).")
    return size // world_size


def check_shape(loaded_weight: torch.Tensor, *full_shape: int) -> None:
    """Checkpoint tensors are checked against their full (unsplit) shape."""
    if tuple(loaded_weight.shape) != full_shape:
        raise ValueError(f"has shape {tuple(loaded_weight.shape)}, expected {full_shape}.")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
    """A parameter every rank holds whole (norms)."""
    check_shape(loaded_weight, *param.shape)
    param.data.copy_(loaded_weight)


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight scale as one float32 per output row [rows, 1]: per-channel ([rows] or [rows, 1])
    as is, a per-tensor scalar repeated."""
    scale = scale.float().reshape(-1, 1)
    return scale.expand(rows, 1) if scale.shape[0] == 1 else scale


def quantized_op(layer: QuantizedWeight, activation: str | None = None):
    """op(x, weight, bias=None) of an int4 layer (the door's `int4_linear` on CUDA) or, off CUDA, of an FP8 or
    int4 layer (their references); with `activation` ("silu" / "gelu_tanh") applied to a gate/up input first,
    as its own kernel. (On CUDA an FP8 layer binds the door's 16-bit entry points with its `weight_scale`.)"""
    if layer.weight.is_cuda:
        from heron.kernels.activation import gelu_tanh_and_mul, silu_and_mul
        from heron.kernels.gemm.int4 import int4_linear as linear

        assert layer.is_int4, "an FP8 layer takes the matmul door's linear on CUDA"
        acts = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
    else:
        linear = fp8_linear_ref if layer.is_fp8 else int4_linear_ref
        acts = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}
    if layer.is_fp8:
        op = partial(linear, weight_scale=layer.weight_scale)
    else:
        op = partial(linear, weight_scale=layer.weight_scale, weight_zero_point=layer.weight_zero_point)
    if activation is None:
        return op
    act = acts[activation]

    def act_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return op(act(x), weight, bias)

    return act_linear


class QuantizedWeight:
    """What the projection layers share to hold an FP8 or int4 weight."""

    weight: nn.Parameter
    weight_scale: nn.Parameter | None  # registered as None by the layer: a 16/32-bit weight has none
    weight_zero_point: nn.Parameter | None  # int4 formats with zero points only

    def use_fp8(self) -> None:
        """Hold the weight in float8 e4m3 with `weight_scale` [N, 1] (float32), filled by the loader; call before
        the weights are loaded (on `meta` too)."""
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device), requires_grad=False
        )
        self.bind_ops()

    def use_int4(self, group_size: int, zero_point: bool) -> None:
        """Hold the weight packed in int4 (int32 [N, K/8]) with float32 `weight_scale` [N, K/G] and, with
        `zero_point`, uint8 `weight_zero_point` [N, K/G], filled by the loader (heron/models/int4_formats.py
        converts each checkpoint format); call before the weights are loaded (on `meta` too). `group_size` G: -1
        for one group per row; it must split this rank's K inputs into whole groups (so a row-parallel split
        falls on group boundaries) and be a multiple of 16 (the kernel's least K tile)."""
        w = self.weight
        n, k = w.shape
        group = k if group_size == -1 else group_size
        if k % group or group % 16:
            raise ValueError(
                f"int4 group_size {group_size} does not split a projection's {k} inputs (on this rank) into whole "
                "groups of a multiple of 16."
            )
        empty = partial(torch.empty, device=w.device)
        self.weight = nn.Parameter(empty(n, k // 8, dtype=torch.int32), requires_grad=False)
        self.weight_scale = nn.Parameter(empty(n, k // group, dtype=torch.float32), requires_grad=False)
        if zero_point:
            self.weight_zero_point = nn.Parameter(empty(n, k // group, dtype=torch.uint8), requires_grad=False)
        self.bind_ops()

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    @property
    def is_int4(self) -> bool:
        return self.weight.dtype == torch.int32

    def needs_quantized_op(self, on_cuda: bool) -> bool:
        """Whether the layer runs `quantized_op` rather than the matmul door's (16-bit or FP8) entry points, on
        CUDA or not (asked by a NormLinear too, which may be moved before its projection)."""
        return self.is_int4 or (self.is_fp8 and not on_cuda)


class ColumnParallelLinear(QuantizedWeight, DeviceOps):
    """y = x W^T + b with W's rows (output features) split over ranks; returns this rank's columns of y.

    `output_sizes` lists the full sizes of the matrices fused into one (q, k, v or gate, up): each is split on
    its own, so a rank holds [its q | its k | its v], the layout the model's split expects. A checkpoint may hold
    them apart (one shard_id each) or fused already (shard_id None: the whole [q | k | v]).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.output_sizes = output_sizes
        self.local_sizes = [divide(s, self.tp_size, "output size") for s in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size))
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes))) if bias else None
        self.register_parameter("weight_scale", None)
        self.register_parameter("weight_zero_point", None)
        self.matmul_plans = plans_for_new_layer()
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.needs_quantized_op(self.weight.is_cuda):
            self._linear = quantized_op(self)
        elif self.weight.is_cuda:
            from heron.kernels.gemm.linear import linear

            self._linear = partial(linear, plans=self.matmul_plans, weight_scale=self.weight_scale)
        else:
            self._linear = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        """`loaded_weight`: the full matrix (or bias, or weight scale) of fused part `shard_id`, or of all parts at
        once (None)."""
        if param is self.weight_scale and self.is_fp8:
            loaded_weight = row_scales(
                loaded_weight, sum(self.output_sizes) if shard_id is None else self.output_sizes[shard_id]
            )
        if shard_id is None and len(self.output_sizes) > 1:
            check_shape(loaded_weight, sum(self.output_sizes), *param.shape[1:])
            for shard, part in enumerate(loaded_weight.split(self.output_sizes)):
                self.weight_loader(param, part, shard)
            return
        shard_id = shard_id or 0
        check_shape(loaded_weight, self.output_sizes[shard_id], *param.shape[1:])
        size = self.local_sizes[shard_id]
        dst = param.data.narrow(0, sum(self.local_sizes[:shard_id]), size)
        dst.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(QuantizedWeight, DeviceOps):
    """y = x W^T + b with W's columns (input features) split over ranks: x arrives already split (the output of a
    ColumnParallelLinear), each rank's product is a partial sum, one all-reduce adds them, and the bias is added
    once after it.

    `swiglu`: x is this rank's [gate | up] of a gate/up projection, and silu(gate) * up is the input (a down
    projection; at decode sizes on CUDA the activation runs in the GEMV's prologue). `geglu`: likewise with
    gelu_tanh(gate) * up (Gemma), always its own kernel first: the GEMV's prologue computes SiLU only."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, swiglu: bool = False, geglu: bool = False
    ) -> None:
        super().__init__()
        assert not (swiglu and geglu), "one activation"
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.input_size, self.output_size, self.swiglu, self.geglu = input_size, output_size, swiglu, geglu
        self.local_input = divide(input_size, self.tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.register_parameter("weight_scale", None)
        self.register_parameter("weight_zero_point", None)
        self.matmul_plans = plans_for_new_layer()
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.needs_quantized_op(self.weight.is_cuda):
            activation = "silu" if self.swiglu else "gelu_tanh" if self.geglu else None
            self._linear = quantized_op(self, activation)
        elif self.weight.is_cuda:
            from heron.kernels.gemm.linear import gelu_tanh_mul_linear, linear, silu_mul_linear

            op = silu_mul_linear if self.swiglu else gelu_tanh_mul_linear if self.geglu else linear
            self._linear = partial(op, plans=self.matmul_plans, weight_scale=self.weight_scale)
        else:
            self._linear = silu_mul_linear_ref if self.swiglu else gelu_tanh_mul_linear_ref if self.geglu else F.linear

    def forward(self, x: torch.Tensor, lora: LoRAWeights | None = None) -> torch.Tensor:
        """`lora` (CUDA, one rank): plus the delta of these LoRA adapters over the input, by the matmul door."""
        if lora is not None:
            assert self.tp_size == 1, "LoRA runs on one tensor-parallel rank"
            return self._linear(x, self.weight, self.bias, lora=lora)
        if self.tp_size == 1:
            return self._linear(x, self.weight, self.bias)
        y = tensor_model_parallel_all_reduce(self._linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if param is self.bias:
            return default_weight_loader(param, loaded_weight)
        if param is self.weight_scale and self.is_fp8:  # a row's scale holds for every rank's columns of it
            return default_weight_loader(param, row_scales(loaded_weight, self.output_size))
        # int4: the packed words, group scales and zeros split as the columns do, whole groups per rank; a
        # per-row scale (one group, G = K) holds for every rank's columns
        local = param.shape[1]
        whole = param is not self.weight and loaded_weight.shape[1:] == (1,) and local == 1
        check_shape(loaded_weight, self.output_size, local if whole else local * self.tp_size)
        param.data.copy_(loaded_weight.narrow(1, 0 if whole else self.tp_rank * local, local))


class ReplicatedLinear(DeviceOps):
    """y = x W^T + b held whole by every rank: a small projection whose whole output each rank needs (an MoE
    router's logits, Qwen2-MoE's shared-expert gate). Through the matmul door on CUDA, F.linear elsewhere."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.matmul_plans = plans_for_new_layer()
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.weight.is_cuda:
            from heron.kernels.gemm.linear import linear

            self._linear = partial(linear, plans=self.matmul_plans)
        else:
            self._linear = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)
