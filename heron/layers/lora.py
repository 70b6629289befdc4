"""Batched LoRA: one projection's adapters held in `max_loras` slots, and the wrappers that add their delta
to a layer's output for every token of a batch at once, each token with its own slot (-1: the base model).

A slot's adapter is y += (x A^T) B^T, its scaling folded into B. A fused projection (q/k/v, gate/up) holds
one A per part, stacked along the rank axis, and B block-diagonal: part p's rank rows feed only part p's
output columns. On CUDA the delta is the gathered kernel (heron/kernels/lora.py: shrink and expand-add over
the step's tokens grouped by slot, each adapter's matrices read once per 16 of its tokens): the wrappers hand
the adapters to the base projection's matmul door. At batch 1 the GEMV runs the shrink in its own grid and
adds the expanded delta in its epilogue (no launch more than the base model). Past one row a 16-bit
projection's weight has every slot's A rows under it (`LoRAStack.extend`): the base's own product makes the
shrink's sums and only the expand runs, gate/up's past 16 rows inside the activation after it (the down
projection's door). A float8 or biased projection runs the shrink on the input its path has. Elsewhere the
delta is the dense product against every slot (`lora_ref`: two matmuls, each token's columns of the other
slots zeroed in between). Both have fixed shapes for any mix of adapters (CUDA-graph safe), no loop over
adapters or requests, no host sync.

Built only with `enable_lora`: a model without it keeps its layers as they are and pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from heron.kernels.reference import gelu_tanh_and_mul_ref, lora_ref, rms_norm_ref, silu_and_mul_ref
from heron.layers.device_ops import DeviceOps
from heron.layers.layernorm import NormLinear

if TYPE_CHECKING:
    from heron.kernels.lora import LoRAWeights

ACT_REFS = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}  # a gated MLP's activations by name


@dataclass
class LoRAMapping:
    """A step's adapters per token row, on the device, filled by the model runner before each forward and read
    by every stack: `token_slots` [max_tokens] (each row's slot, -1: none); for the kernel, `sorted_tokens`
    [max_tokens] (the adapted rows grouped by slot) and `slot_start` [max_loras + 1] (each slot's run in it)."""

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_start: torch.Tensor


class LoRAStack(DeviceOps):
    """The adapters of one projection: A [slots, parts * rank, in] and B [slots, parts * rank, out] (B stored
    transposed, so that the expand is a plain matmul), zero in a free slot."""

    def __init__(
        self, input_size: int, output_sizes: list[int], max_loras: int, max_rank: int, mapping: LoRAMapping
    ) -> None:
        super().__init__()
        self.input_size, self.output_sizes, self.max_rank = input_size, output_sizes, max_rank
        rows = len(output_sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, rows, input_size), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, rows, sum(output_sizes)), persistent=False)
        self.mapping = mapping  # the runner's, shared by every stack
        # a gated MLP's gate/up stack `gives` its delta to the activation in its down stack's door, which `takes`
        # it from the same box (heron/kernels/lora.py's LoRAWeights; set by heron/models/lora.py's add_lora)
        self.gives: list | None = None
        self.takes: list | None = None
        self.register_buffer("extended", None, persistent=False)  # see `extend`
        self.base: nn.Module | None = None
        self.bind_ops()

    def extend(self, base: nn.Module) -> None:
        """Keep every slot's A rows under the base projection's weight [N, in], in one [N + slots * parts * rank,
        in] tensor whose first N rows the weight becomes (a view: the base's kernels read it as before), so
        that one GEMM over a step of more than one row makes the base's output and every slot's shrink (the
        matmul door, `LoRAWeights.extends`): no shrink launch, for a few % more columns. For a weight of the
        adapters' dtype (not float8 or int4). `base` stays the owner's child: this module keeps a reference."""
        assert base.weight.dtype == self.lora_a.dtype and base.weight.shape[1] == self.input_size
        self.__dict__["base"] = base  # (not a submodule: its parameters keep their one name)
        weight, n = base.weight, base.weight.shape[0]
        extended = torch.cat([weight.data, self.lora_a.reshape(-1, self.input_size)])
        weight.data = extended[:n]
        self.lora_a = extended[n:].view(self.lora_a.shape)
        self.extended = extended

    def bind_ops(self) -> None:
        if self.extended is not None and not _same_storage(self.extended, self.lora_a, self.base.weight):
            raise RuntimeError("a model with LoRA adapters was moved or cast: move it before add_lora")
        if self.lora_a.is_cuda:
            from heron.kernels.lora import LoRAWeights

            self._weights = LoRAWeights
        else:
            self._weights = None

    @property
    def on_cuda(self) -> bool:
        """Whether the delta runs in the kernels (the matmul door takes `weights`)."""
        return self._weights is not None

    @property
    def weights(self) -> LoRAWeights:
        """CUDA: the slots and the step's token mapping, as the matmul door and the kernels take them."""
        m = self.mapping
        return self._weights(
            self.lora_a,
            self.lora_b,
            m.token_slots,
            m.sorted_tokens,
            m.slot_start,
            self.output_sizes,
            self.max_rank,
            self.gives,
            self.takes,
            self.extended,
        )

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Load one adapter's stacked A [parts * rank, in] and transposed B [parts * rank, out] into `slot`."""
        self.lora_a[slot].copy_(a)
        self.lora_b[slot].copy_(b)

    def add_to(
        self, y: torch.Tensor, x: torch.Tensor, act: str | None = None, norm: tuple[torch.Tensor, float] | None = None
    ) -> torch.Tensor:
        """y [T, out] += the delta of each token's adapter (none for the base model's tokens) for the input made
        from x: x itself [T, in]; act(gate) * up of a gated MLP's x [T, 2 * in] (`act`: "silu", "gelu_tanh");
        weight * rmsnorm(x) (`norm`: (weight, eps)). The dense reference: on CUDA the wrappers hand `weights` to
        the base projection's matmul door instead."""
        if act is not None:
            x = ACT_REFS[act](x)
        elif norm is not None:
            x = rms_norm_ref(x, *norm)
        return y.add_(lora_ref(x, self.lora_a, self.lora_b, self.mapping.token_slots))


def _same_storage(*tensors: torch.Tensor) -> bool:
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1


class LinearWithLoRA(nn.Module):
    """A projection (o, down) plus its adapters' delta. `act` ("silu", "gelu_tanh") where the layer applies a
    gated activation to its input first (down: act(gate) * up of the gate/up projection's output)."""

    def __init__(self, base: nn.Module, lora: LoRAStack, act: str | None) -> None:
        super().__init__()
        self.base, self.lora, self.act = base, lora, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora.on_cuda:  # the base's matmul door runs the adapters over its input
            return self.base(x, lora=self.lora.weights)
        return self.lora.add_to(self.base(x), x, act=self.act)


class NormLinearWithLoRA(nn.Module):
    """A pre-norm block's entry (NormLinear: residual add, norm, q/k/v or gate/up) plus the adapters' delta,
    whose input is the normed hidden state: on CUDA the block's matmul door runs the adapters over it (at decode
    sizes the shrink makes it from the block's x and residual as it reads them); elsewhere the delta's input is
    normed again from the residual the block returns."""

    def __init__(self, base: NormLinear, lora: LoRAStack) -> None:
        super().__init__()
        self.base, self.lora = base, lora

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lora.on_cuda:
            return self.base(x, residual, lora=self.lora.weights)
        y, residual = self.base(x, residual)
        return self.lora.add_to(y, residual, norm=(self.base.weight, self.base.eps)), residual
