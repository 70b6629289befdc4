"""The gathered LoRA kernel against the dense reference (`lora_ref`, what the CPU runs): random slots with base
tokens between, fused projections of uneven parts (column tiles across part boundaries), ranks below and above
one rank tile, more tokens of one slot than one token tile, a step of base tokens only, the shrink split over
`in`. On CPU under Triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from heron.executor.lora_manager import group_by_slot
from heron.kernels.lora import _shrink_kernel, lora_shrink, shrink_splits
from heron.kernels.reference import gelu_tanh_and_mul_ref, lora_ref, rms_norm_ref, silu_and_mul_ref
from tests.kernels.kernel_utils import pick_device, random_adapters, rel_err, skip_unless_runnable

DEVICE = pick_device()

skip_unless_runnable(_shrink_kernel, DEVICE)


CASES = [
    # (tokens' slots, in, output parts, max_rank, each slot's rank)
    ([0, -1, 1, 1, 2, 0, -1], 48, [40, 24, 24], 4, [4, 2, 3]),
    ([2] * 37 + [-1, 0, 1] * 3, 200, [300], 24, [24, 5, 17]),
    ([1, 0] * 9, 64, [136, 136], 8, [8, 8]),
    ([-1, -1, -1], 32, [32], 16, [16]),
    ([3], 32, [72, 8, 8], 16, [9, 16, 1, 16]),
    ([0, 1, 2, 3, 4, 5, 6, 7] * 3 + [-1] * 4, 40, [24, 16, 16], 4, [1, 2, 3, 4, 4, 3, 2, 1]),  # tiles across runs
]


def lora_add_(y, x, *weights_and_mapping, **kwargs):
    """The shrink, then the expand into y in place: what a projection's delta costs."""
    return lora_shrink(x, *weights_and_mapping, **kwargs).add_to_(y)


# relative error: float32 exact but for the order of sums; bf16 the dot's operands and the output rounded once each
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


SPLIT_CASES = [  # split-K: `in` of 5.5 tiles in 2, 3 (ranges rounded up to whole tiles) and 6 (one tile each)
    ([1, -1, 0, 0, 1] * 4, 700, [40, 24, 24], 8, [8, 5], splits) for splits in (2, 4, 6)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("slots", "in_size", "out_sizes", "max_rank", "ranks", "splits"), [c + (None,) for c in CASES])
def test_gathered_kernel_equals_the_dense_reference(slots, in_size, out_sizes, max_rank, ranks, splits, dtype):
    gen = torch.Generator().manual_seed(len(slots))
    a, b = random_adapters(len(ranks), in_size, out_sizes, max_rank, ranks, gen)
    x = torch.randn(len(slots), in_size, generator=gen)
    y = torch.randn(len(slots), sum(out_sizes), generator=gen)
    a, b, x, y = (t.to(dtype) for t in (a, b, x, y))
    token_slots = torch.tensor(slots)
    want = y.float() + lora_ref(x.float(), a.float(), b.float(), token_slots)
    order, starts = group_by_slot(np.array(slots), len(ranks))
    sorted_tokens = torch.from_numpy(np.concatenate([order, [-7] * 5]))  # past the runs: never read
    args = [t.to(DEVICE) for t in (y, x, a, b, token_slots, sorted_tokens, torch.from_numpy(starts))]
    got = lora_add_(*args, out_sizes, max_rank, splits)
    assert got.data_ptr() == args[0].data_ptr()  # in place
    assert rel_err(got.cpu(), want) < TOL[dtype]
    base = token_slots < 0
    assert torch.equal(got.cpu()[base], y[base])  # the base model's rows untouched


@pytest.mark.parametrize(("slots", "in_size", "out_sizes", "max_rank", "ranks", "splits"), SPLIT_CASES)
def test_split_shrink_equals_the_dense_reference(slots, in_size, out_sizes, max_rank, ranks, splits):
    test_gathered_kernel_equals_the_dense_reference(slots, in_size, out_sizes, max_rank, ranks, splits, torch.float32)


PROLOGUE_CASES = [  # (tokens' slots, in, output parts, max_rank, each slot's rank, splits)
    ([0, -1, 1, 1, 2, 0, -1], 48, [40, 24, 24], 4, [4, 2, 3], None),
    ([1, -1, 0, 0, 1] * 4, 700, [40, 24], 8, [8, 5], 3),  # split-K: each split's sums of squares
    ([2] * 19 + [-1, 0, 1], 200, [136], 16, [16, 5, 9], 2),  # a slot's run over two token tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prologue", ["silu", "gelu_tanh", "norm", "norm_residual"])
@pytest.mark.parametrize(("slots", "in_size", "out_sizes", "max_rank", "ranks", "splits"), PROLOGUE_CASES)
def test_the_shrink_makes_its_input_as_the_references_do(
    slots, in_size, out_sizes, max_rank, ranks, splits, prologue, dtype
):
    """A down projection's input from [gate | up], a pre-norm block's from the residual stream (h = x, or x +
    residual added in the shrink): the delta equals the dense reference's over the references' input (the norm
    rounds h * weight once where rms_norm_ref rounds twice: within the bf16 tolerance)."""
    gen = torch.Generator().manual_seed(len(slots) + len(prologue))
    a, b = random_adapters(len(ranks), in_size, out_sizes, max_rank, ranks, gen)
    x = torch.randn(len(slots), in_size if prologue.startswith("norm") else 2 * in_size, generator=gen) * 2
    residual = torch.randn(len(slots), in_size, generator=gen)
    weight = torch.rand(in_size, generator=gen) + 0.5
    y = torch.randn(len(slots), sum(out_sizes), generator=gen)
    a, b, x, y, weight, residual = (t.to(dtype) for t in (a, b, x, y, weight, residual))
    make = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}.get(prologue)
    if make:
        u, kwargs = make(x), {"act": prologue}
    elif prologue == "norm":
        u, kwargs = rms_norm_ref(x, weight, 1e-5), {"norm": (weight.to(DEVICE), 1e-5)}
    else:
        u = rms_norm_ref(x, weight, 1e-5, residual)[0]
        kwargs = {"norm": (weight.to(DEVICE), 1e-5), "residual": residual.to(DEVICE)}
    token_slots = torch.tensor(slots)
    want = y.float() + lora_ref(u.float(), a.float(), b.float(), token_slots)
    order, starts = group_by_slot(np.array(slots), len(ranks))
    args = [t.to(DEVICE) for t in (y, x, a, b, token_slots, torch.from_numpy(order), torch.from_numpy(starts))]
    got = lora_add_(*args, out_sizes, max_rank, splits, **kwargs)
    assert rel_err(got.cpu(), want) < TOL[dtype]
    base = token_slots < 0
    assert torch.equal(got.cpu()[base], y[base])


ACT_CASES = [  # (tokens' slots, in, intermediate size, max_rank, each slot's rank, splits)
    ([0, -1, 1, 1, 2, 0, -1], 48, 40, 4, [4, 2, 3], None),
    ([1, -1, 0, 0, 1] * 4, 700, 72, 8, [8, 5], 3),  # split-K; column tiles across gate's end
    ([2] * 19 + [-1, 0, 1] + [-1] * 12, 64, 136, 16, [16, 5, 9], None),  # runs over two token tiles; base tiles
    ([-1, -1, -1], 32, 24, 16, [16], None),  # no adapter in the step
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("slots", "in_size", "inter", "max_rank", "ranks", "splits"), ACT_CASES)
def test_the_expand_inside_the_activation_equals_the_references(
    slots, in_size, inter, max_rank, ranks, splits, act, dtype
):
    """A gate/up projection's delta added inside its activation (`LoRADelta.act_and_mul`, the door's path past 16
    rows): act(gate) * up of y plus the dense reference's delta, every row written, the base model's rows as the
    plain activation kernel makes them."""
    from heron.kernels.activation import gelu_tanh_and_mul, silu_and_mul

    gen = torch.Generator().manual_seed(len(slots) + inter)
    a, b = random_adapters(len(ranks), in_size, [inter, inter], max_rank, ranks, gen)
    x = torch.randn(len(slots), in_size, generator=gen)
    y = torch.randn(len(slots), 2 * inter, generator=gen) * 2
    a, b, x, y = (t.to(dtype) for t in (a, b, x, y))
    token_slots = torch.tensor(slots)
    act_ref = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}[act]
    want = act_ref((y.float() + lora_ref(x.float(), a.float(), b.float(), token_slots)).to(dtype))
    order, starts = group_by_slot(np.array(slots), len(ranks))
    args = [t.to(DEVICE) for t in (x, a, b, token_slots, torch.from_numpy(order), torch.from_numpy(starts))]
    delta = lora_shrink(*args, [inter, inter], max_rank, splits)
    got = delta.act_and_mul(y.to(DEVICE), act == "gelu_tanh").cpu()
    assert got.shape == (len(slots), inter) and rel_err(got, want) < TOL[dtype]
    plain = (gelu_tanh_and_mul if act == "gelu_tanh" else silu_and_mul)(y.to(DEVICE)).cpu()
    base = token_slots < 0
    assert torch.equal(got[base], plain[base])


def test_shrink_splits_cover_the_gpu_at_decode_sizes_only():
    cpu = torch.device("cpu")  # counted as 4 SMs
    assert shrink_splits(1, 16, 12288, cpu) == 8  # batch 1: one program before the split
    assert shrink_splits(1, 16, 128, cpu) == 2  # never a range shorter than one tile
    assert shrink_splits(8192, 48, 4096, cpu) == 1  # a prefill step's grid is large enough


def test_group_by_slot():
    order, starts = group_by_slot(np.array([2, -1, 0, 2, 0, -1, 1]), 4)
    assert order.tolist() == [2, 4, 6, 0, 3, 1, 5] and starts.tolist() == [0, 2, 3, 5, 5]  # the base model's last


EXTENDED_CASES = [CASES[0] + (None,), CASES[5] + (None,), CASES[2] + (None,), CASES[2] + ("silu",)]  # (..., act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("slots", "in_size", "out_sizes", "max_rank", "ranks", "act"), EXTENDED_CASES)
def test_the_expand_of_an_extended_product_equals_the_references(
    slots, in_size, out_sizes, max_rank, ranks, act, dtype
):
    """Every slot's A rows under the base weight (`LoRAWeights.extended`): one product of x by it makes the base's
    output and, past its N columns, every slot's sums; the expand (or, for a gate/up pair, the activation) reads
    each row's slot's sums from there. Equals F.linear plus the dense reference's delta, on a strided output."""
    from heron.kernels.lora import LoRAWeights, extended_delta

    gen = torch.Generator().manual_seed(len(slots) + in_size)
    a, b = random_adapters(len(ranks), in_size, out_sizes, max_rank, ranks, gen)
    n = sum(out_sizes)
    w = torch.randn(n, in_size, generator=gen) / in_size**0.5
    x = torch.randn(len(slots), in_size, generator=gen)
    a, b, w, x = (t.to(dtype) for t in (a, b, w, x))
    token_slots = torch.tensor(slots)
    extended = torch.cat([w, a.reshape(-1, in_size)])
    y = (x.float() @ extended.float().T).to(dtype)  # the base GEMM's output, rounded once
    want = y[:, :n].float() + lora_ref(x.float(), a.float(), b.float(), token_slots)
    order, starts = group_by_slot(np.array(slots), len(ranks))
    mapping = [t.to(DEVICE) for t in (token_slots, torch.from_numpy(order), torch.from_numpy(starts))]
    weights = LoRAWeights(a.to(DEVICE), b.to(DEVICE), *mapping, out_sizes, max_rank, extended=extended.to(DEVICE))
    y = y.to(DEVICE)
    delta = extended_delta(weights, y, n)
    if act:
        got, want = delta.act_and_mul(y[:, :n], gelu_tanh=False).cpu(), silu_and_mul_ref(want.to(dtype))
    else:
        got = delta.add_to_(y[:, :n]).cpu()
    assert rel_err(got, want) < 2 * TOL[dtype]
