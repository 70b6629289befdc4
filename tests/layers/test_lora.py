"""The batched LoRA delta: every token with its own slot's adapter (or none) in two matmuls over the batch,
equal to adding each token's adapter alone; the wrappers add it to their layer's output."""

from __future__ import annotations

import torch

from heron.kernels.reference import rms_norm_ref, silu_and_mul_ref
from heron.layers.layernorm import NormLinear
from heron.layers.linear import ColumnParallelLinear, RowParallelLinear
from heron.layers.lora import LinearWithLoRA, LoRAMapping, LoRAStack, NormLinearWithLoRA


def _stack(in_size: int, out_sizes: list[int], slots: torch.Tensor, num_slots: int = 3, rank: int = 4) -> LoRAStack:
    unused = torch.empty(0, dtype=torch.long)  # the kernel's grouping: CUDA only
    st = LoRAStack(in_size, out_sizes, num_slots, rank, LoRAMapping(slots, unused, unused))
    for s in range(num_slots - 1):  # the last slot stays free (zero)
        st.set_slot(s, torch.randn(len(out_sizes) * rank, in_size), torch.randn(len(out_sizes) * rank, sum(out_sizes)))
    return st


def _delta(st: LoRAStack, x: torch.Tensor) -> torch.Tensor:
    return st.add_to(torch.zeros(x.shape[0], sum(st.output_sizes)), x)


def test_each_token_gets_its_own_slots_delta():
    torch.manual_seed(0)
    slots = torch.tensor([0, -1, 1, 1, 2, 0, -1])
    st = _stack(16, [8, 4, 4], slots)
    x = torch.randn(len(slots), 16)
    want = torch.stack(
        [torch.zeros(16) if s < 0 else (x[i] @ st.lora_a[s].t()) @ st.lora_b[s] for i, s in enumerate(slots.tolist())]
    )
    torch.testing.assert_close(_delta(st, x), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(_delta(st, x)[slots < 0], torch.zeros(2, 16))


def test_only_the_rows_of_a_step_are_read_from_the_slot_buffer():
    torch.manual_seed(0)
    slots = torch.tensor([1, 0, -1, -1])  # a buffer longer than the step
    st = _stack(8, [8], slots)
    x = torch.randn(2, 8)
    torch.testing.assert_close(
        _delta(st, x), torch.stack([x[0] @ st.lora_a[1].t() @ st.lora_b[1], x[1] @ st.lora_a[0].t() @ st.lora_b[0]])
    )


def test_wrappers_add_the_delta_of_the_layers_matrix_input():
    torch.manual_seed(0)
    slots = torch.tensor([0, 1, -1])
    down = RowParallelLinear(8, 6, bias=False, swiglu=True)
    down.weight.data.normal_()
    st = _stack(8, [6], slots)
    gate_up = torch.randn(3, 16)
    torch.testing.assert_close(
        LinearWithLoRA(down, st, "silu")(gate_up), down(gate_up) + _delta(st, silu_and_mul_ref(gate_up))
    )

    proj = ColumnParallelLinear(8, [4, 4], bias=False)
    proj.weight.data.normal_()
    norm = NormLinear(8, 1e-6, proj)
    norm.weight.data.uniform_(0.5, 1.5)
    st = _stack(8, [4, 4], slots)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    y, res = NormLinearWithLoRA(norm, st)(x, residual)
    torch.testing.assert_close(res, x + residual)
    torch.testing.assert_close(
        y,
        proj(rms_norm_ref(x + residual, norm.weight, 1e-6)) + _delta(st, rms_norm_ref(x + residual, norm.weight, 1e-6)),
    )
