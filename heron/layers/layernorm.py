"""RMSNorm, and NormLinear: an RMSNorm built with the projection it feeds, so that a pre-norm block's entry
(residual add, norm, projection) runs as one GEMV kernel at decode sizes on CUDA.

Gemma's norms scale by (1 + w) and its checkpoints store w: built with `weight_offset=1.0` a norm loads 1 + w
(summed in float32, rounded once to the weight's dtype) and computes as any other."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from heron.distributed import get_tp_world_size
from heron.kernels.reference import fused_add_rms_norm_ref, rms_norm_linear_ref, rms_norm_ref
from heron.layers.device_ops import DeviceOps
from heron.layers.linear import ColumnParallelLinear, default_weight_loader

if TYPE_CHECKING:
    from heron.kernels.lora import LoRAWeights


class _OffsetWeight:
    weight_offset: float

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        """The checkpoint's weight, plus `weight_offset`."""
        default_weight_loader(param, loaded_weight.float() + self.weight_offset)


class RMSNorm(_OffsetWeight, DeviceOps):
    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.weight_offset = eps, weight_offset
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.weight.is_cuda:
            from heron.kernels.rmsnorm import fused_add_rms_norm, rms_norm

            self._norm, self._add_norm = rms_norm, fused_add_rms_norm
        else:
            self._norm, self._add_norm = rms_norm_ref, fused_add_rms_norm_ref

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: adds it first and returns (normed, x + residual), the pre-norm pattern."""
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)


class NormLinear(_OffsetWeight, DeviceOps):
    """The RMSNorm of a pre-norm block (its weight is this module's, under the norm's checkpoint name) together
    with the projection that takes its output: `forward(x, residual)` returns (proj(rmsnorm(x + residual)),
    x + residual), x itself being the residual in the first layer. At decode sizes on CUDA the norm runs in the
    GEMV's prologue (heron/kernels/gemm/linear.py: `rms_norm_linear`). `proj` stays a child of the module that
    owns it (attention's qkv_proj, the MLP's gate_up_proj): this module only reads its weights."""

    def __init__(self, dim: int, eps: float, proj: ColumnParallelLinear, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.weight_offset = eps, weight_offset
        self.__dict__["proj"] = proj  # a reference, not a submodule: its parameters keep their one name
        self.bind_ops()

    def bind_ops(self) -> None:
        # the GEMV's norm prologue reads a 16/32-bit or FP8 weight: an int4 projection (or an FP8 one off CUDA)
        # runs the norm, then its own matmul
        if self.proj.needs_quantized_op(self.weight.is_cuda):
            if self.weight.is_cuda:
                from heron.kernels.rmsnorm import fused_add_rms_norm, rms_norm

                self._norm_linear = partial(_norm_then_proj, rms_norm, fused_add_rms_norm, self.proj)
            else:
                self._norm_linear = partial(_norm_then_proj, rms_norm_ref, fused_add_rms_norm_ref, self.proj)
        elif self.weight.is_cuda:
            from heron.kernels.gemm.linear import rms_norm_linear

            self._norm_linear = partial(_door_norm_linear, rms_norm_linear, self.proj)
        else:
            self._norm_linear = rms_norm_linear_ref

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, lora: LoRAWeights | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`lora` (CUDA): plus the delta of these LoRA adapters over the normed rows, by the matmul door."""
        if lora is not None:
            return self._norm_linear(x, residual, self.weight, self.eps, self.proj.weight, self.proj.bias, lora=lora)
        return self._norm_linear(x, residual, self.weight, self.eps, self.proj.weight, self.proj.bias)


def _door_norm_linear(
    op: Callable,
    proj: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: LoRAWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The door's `rms_norm_linear` (op) with proj's matmul plans and FP8 scales read at each call, not at
    binding: this module may be moved before proj, whose move then replaces its tensors."""
    plans, scale = proj.matmul_plans, proj.weight_scale
    return op(x, residual, norm_weight, eps, weight, bias, plans=plans, weight_scale=scale, lora=lora)


def _norm_then_proj(
    norm: Callable,
    add_norm: Callable,
    proj: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_linear`'s contract over a projection that runs its own matmul (an int4 one): the norm's kernel,
    then proj (which holds `weight` and `bias`)."""
    if residual is None:
        normed, residual = norm(x, norm_weight, eps), x
    else:
        normed, residual = add_norm(x, residual, norm_weight, eps)
    return proj(normed), residual


class LinearNormLinear(DeviceOps):
    """A projection, the RMSNorm after it (its weight is this module's, under the norm's checkpoint name) and a
    small projection of the normed rows: `forward(x, residual)` returns (second(normed), normed, h) for
    h = first(x) + residual and normed = rmsnorm(h) (a MoE layer: the attention's o_proj, the post-attention
    norm and the router). On CUDA with one rank, one kernel at batch 1 (heron/kernels/gemm/linear.py:
    `linear_norm_linear`); elsewhere the three ops. `first` and `second` stay children of their owners."""

    def __init__(self, dim: int, eps: float, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.__dict__["first"], self.__dict__["second"] = first, second  # references, not submodules
        self.bind_ops()

    def bind_ops(self) -> None:
        fusable = get_tp_world_size() == 1 and not self.first.needs_quantized_op(self.weight.is_cuda)
        if self.weight.is_cuda and fusable:
            from heron.kernels.gemm.linear import linear_norm_linear

            self._op = linear_norm_linear
        else:
            self._op = None
            self._add_norm = fused_add_rms_norm_ref
            if self.weight.is_cuda:
                from heron.kernels.rmsnorm import fused_add_rms_norm

                self._add_norm = fused_add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first, second = self.first, self.second
        if self._op is not None:
            return self._op(
                x, first.weight, residual, self.weight, self.eps, second.weight,
                first.matmul_plans, second.matmul_plans, first.weight_scale,
            )  # fmt: skip
        normed, h = self._add_norm(first(x), residual, self.weight, self.eps)
        return second(normed), normed, h
