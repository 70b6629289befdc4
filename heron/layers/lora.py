"""Batched LoRA: one projection's adapters held in `max_loras` slots, and the wrappers that add their delta
to a layer's output for every token of a batch at once, each token with its own slot (-1: the base model).

A slot's adapter is y += (x A^T) B^T, its scaling folded into B. A fused projection (q/k/v, gate/up) holds
one A per part, stacked along the rank axis, and B block-diagonal: part p's rank rows feed only part p's
output columns. The delta over the whole batch is two matmuls against all slots at once, shrink
x [T, in] @ A [S*R, in]^T -> [T, S*R], then expand after zeroing each token's columns of the other slots,
[T, S*R] @ B [S*R, out]: fixed shapes for any mix of adapters (CUDA-graph safe), no loop over adapters or
requests, no host sync. It pays S times the FLOPs of one adapter per token (small beside the base matmul at
ranks up to 64); a gathered Triton SGMV/BGMV kernel is what would pay only the token's own.

Built only with `enable_lora`: a model without it keeps its layers as they are and pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from heron.kernels.reference import rms_norm_ref
from heron.layers.device_ops import DeviceOps
from heron.layers.layernorm import NormLinear


class LoRAStack(nn.Module):
    """The adapters of one projection: A [slots, parts * rank, in] and B [slots, parts * rank, out] (B stored
    transposed, so that the expand is a plain matmul), zero in a free slot. `token_slots` is the step's
    per-token slot index, a buffer the model runner fills before each forward (shared by every stack)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], max_loras: int, max_rank: int, token_slots: torch.Tensor
    ) -> None:
        super().__init__()
        self.input_size, self.output_sizes, self.max_rank = input_size, output_sizes, max_rank
        rows = len(output_sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, rows, input_size), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, rows, sum(output_sizes)), persistent=False)
        self.__dict__["token_slots"] = token_slots  # the runner's, not this module's
        self.register_buffer("slot_ids", torch.arange(max_loras), persistent=False)

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Load one adapter's stacked A [parts * rank, in] and transposed B [parts * rank, out] into `slot`."""
        self.lora_a[slot].copy_(a)
        self.lora_b[slot].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> the delta [T, out] of each token's adapter (zero for the base model's tokens)."""
        num_slots, rows, _ = self.lora_a.shape
        t = x.shape[0]
        shrunk = x @ self.lora_a.view(num_slots * rows, -1).t()
        own = (self.token_slots[:t, None] == self.slot_ids).to(x.dtype)  # [T, slots]: one-hot, or none for -1
        shrunk = (shrunk.view(t, num_slots, rows) * own[:, :, None]).view(t, num_slots * rows)
        return shrunk @ self.lora_b.view(num_slots * rows, -1)


class LinearWithLoRA(nn.Module):
    """A projection (o, down) plus its adapters' delta. `act` turns the layer's input into the matrix's input
    where the layer applies an activation first (down: silu(gate) * up)."""

    def __init__(self, base: nn.Module, lora: LoRAStack, act: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        super().__init__()
        self.base, self.lora, self.act = base, lora, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y.add_(self.lora(x if self.act is None else self.act(x)))


class NormLinearWithLoRA(DeviceOps):
    """A pre-norm block's entry (NormLinear: residual add, norm, q/k/v or gate/up) plus the adapters' delta,
    whose input is the normed hidden state: the fused norm + projection runs as it is and the norm is
    recomputed from the residual it returns."""

    def __init__(self, base: NormLinear, lora: LoRAStack) -> None:
        super().__init__()
        self.base, self.lora = base, lora
        self.bind_ops()

    def bind_ops(self) -> None:
        if self.lora.lora_a.is_cuda:
            from heron.kernels.rmsnorm import rms_norm

            self._norm = rms_norm
        else:
            self._norm = rms_norm_ref

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        y, residual = self.base(x, residual)
        normed = self._norm(residual, self.base.weight, self.base.eps)
        return y.add_(self.lora(normed)), residual
