"""The one-pass Triton sampler (heron.kernels.sampling) against the PyTorch path of heron.executor.sampler:
the same hash bits, the same tokens for mixed rows, and draws that follow the distribution. On CPU this runs
under Triton's interpreter (see conftest.py), so the sizes are small."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from heron.batch import SamplingSpec  # noqa: E402
from heron.executor.sampler import (
    Sampler,
    SamplingTensors,
    gumbel_noise,
    sample_tokens_torch,  # noqa: E402
    sampling_thresholds,
    uniform_noise,
)
from heron.kernels.sampling import _gumbel, _mix64, _sample_kernel, row_logsumexp, sample_tokens  # noqa: E402
from heron.sampling_params import SamplingParams  # noqa: E402
from tests.kernels.kernel_utils import pick_device, skip_unless_runnable  # noqa: E402

DEV = pick_device()

skip_unless_runnable(_sample_kernel, DEV)


@triton.jit
def _noise_kernel(seed_ptr, ctr_ptr, bits_ptr, V, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + r).to(tl.uint64, bitcast=True)
    ctr = tl.load(ctr_ptr + r).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed) + ctr * 0x9E3779B97F4A7C15)
    h = _mix64(key + offs.to(tl.uint64) * 0x9E3779B97F4A7C15)
    tl.store(bits_ptr + r * V + offs, (h >> 12).to(tl.int64, bitcast=True), mask=offs < V)


@triton.jit
def _gumbel_kernel(seed_ptr, ctr_ptr, g_ptr, V, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + r).to(tl.uint64, bitcast=True)
    ctr = tl.load(ctr_ptr + r).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed) + ctr * 0x9E3779B97F4A7C15)
    tl.store(g_ptr + r * V + offs, _gumbel(key + offs.to(tl.uint64) * 0x9E3779B97F4A7C15, LIBDEVICE), mask=offs < V)


def test_hash_bits_are_identical():
    """The kernel's uint64 splitmix64 and the int64 emulation in torch give the same 52 bits."""
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1, 987654321], device=DEV)
    ctrs = torch.tensor([0, (7 << 20) | 3, 1, 2**40 + 5, 123], device=DEV)
    V = 1000
    bits = torch.empty(5, V, dtype=torch.int64, device=DEV)
    _noise_kernel[(5,)](seeds, ctrs, bits, V, BLOCK=1024)
    u = uniform_noise(seeds, ctrs, V)
    assert torch.equal(bits.double() + 0.5, u * 2.0**52)  # exact: u = (bits + 1/2) / 2^52
    assert bits.min() >= 0 and bits.max() < 2**52


def test_gumbel_noise_is_the_same():
    """Bit for bit on a GPU (libdevice's logf is CUDA's, as torch's); under the interpreter numpy's float32
    log and torch's CPU one differ in the last bit now and then."""
    R, V = 8, 4096
    seeds, ctrs = torch.arange(R, device=DEV) * 31 + 2**61, torch.arange(R, device=DEV) * 5
    g = torch.empty(R, V, device=DEV)
    _gumbel_kernel[(R,)](seeds, ctrs, g, V, BLOCK=V, LIBDEVICE=DEV.type == "cuda")
    ref = gumbel_noise(seeds, ctrs, V)
    if DEV.type == "cuda":
        assert torch.equal(g, ref)
    else:
        torch.testing.assert_close(g, ref, rtol=3e-7, atol=3e-7)
    assert ref.max() < 36.8 and ref.min() > -2.9  # E in [2^-53, 16.7)
    assert abs(ref.mean().item() - 0.5772) < 0.02 and abs(ref.std().item() - math.pi / math.sqrt(6)) < 0.02


def _rows(params: list[SamplingParams], seeds: list[int], pos: list[int]):
    """SamplingTensors.build's rows: sample index i % 2 of a 3-token prompt, at output positions `pos`."""
    specs = [SamplingSpec.of(p, s, i % 2, 3) for i, (p, s) in enumerate(zip(params, seeds))]
    return specs, np.array(pos, dtype=np.int64)


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.1, top_k=50, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.5, top_k=1),
]


@pytest.mark.parametrize("block,num_splits", [(None, None), (128, 1), (64, 5)])
def test_kernel_matches_torch_for_mixed_rows(block, num_splits):
    V, R = 1000, len(MIXED)
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        logits = (torch.randn(R, V, generator=gen) * 2.5).to(DEV)
        logits[1, 17] = logits[1, 400] = logits[0, 5] = logits[0, 900] = 30.0  # exact ties: lowest id
        t = SamplingTensors.build(*_rows(MIXED, [11, 2**62 + 1, 5, 6, 7, 8, 9], [step] * R), V, DEV)
        thr = sampling_thresholds(logits, t)
        ref = sample_tokens_torch(logits, t.temperature, thr, t.seeds, t.counters)
        out = sample_tokens(logits, t.temperature, thr, t.seeds, t.counters, block=block, num_splits=num_splits)
        assert torch.equal(out, ref), (step, out, ref)
        assert out[0] == 5  # greedy tie between 5 and 900
        via_sampler = Sampler(backend="triton")(logits, t).token_ids
        assert torch.equal(via_sampler, ref)


def test_edge_rows_and_bf16():
    """All -inf rows (token 0), every token masked by the threshold, NaNs (never drawn), bf16 logits."""
    V = 300
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)).to(DEV)
    logits[0] = float("-inf")
    logits[2, ::3] = float("nan")
    temp = torch.tensor([1.0, 1.0, 0.8, 1.2], device=DEV)
    thr = torch.tensor([float("-inf"), 1e9, float("-inf"), 0.5], device=DEV)
    seeds, ctrs = torch.arange(4, device=DEV), torch.arange(4, device=DEV) * 3
    ref = sample_tokens_torch(logits, temp, thr, seeds, ctrs)
    out = sample_tokens(logits, temp, thr, seeds, ctrs, block=64, num_splits=2)
    assert torch.equal(out, ref)
    assert out[0] == 0 and out[1] == 0 and out[2] % 3 != 0 and logits[3, out[3]] >= 0.5
    half = logits.bfloat16()
    assert torch.equal(
        sample_tokens(half, temp, thr, seeds, ctrs, block=128), sample_tokens_torch(half, temp, thr, seeds, ctrs)
    )


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_thresholds", [False, True])
def test_ties_and_empty_rows_across_tiles_and_splits(num_splits, with_thresholds):
    """Sampled scores tie only at +inf: the lowest token id must win across tiles at the same lane, across
    lanes (a lower id in a higher lane), and across splits; all -inf and all NaN rows give token 0; a split
    without a finite score must not win. Block 16 over 100 tokens: 7 tiles (3 splits: tiles 0-2, 3-5, 6)."""
    V, inf, nan = 100, float("inf"), float("nan")
    x = torch.randn(8, V, generator=torch.Generator().manual_seed(4))
    x[0, [37, 69]] = inf  # tiles 2 and 4, both lane 5
    x[1, [40, 51]] = inf  # tile 2 lane 8, tile 3 lane 3
    x[2] = -inf
    x[3] = nan
    x[4, ::2] = nan
    x[4, 71] = inf
    x[5, [20, 60]] = inf  # splits 0 and 1
    x[6, :64] = -inf  # splits 0 and 1 hold only -inf
    x[7, [37, 69]] = 5.0 + x[7].abs().max()  # greedy row: the same-lane tie
    x = x.to(DEV)
    temp = torch.tensor([0.6] * 7 + [0.0], device=DEV)
    thr = torch.full((8,), -inf, device=DEV) if with_thresholds else None
    seeds, ctrs = torch.arange(8, device=DEV) * 977, torch.arange(8, device=DEV) + 2**33
    out = sample_tokens(x, temp, thr, seeds, ctrs, block=16, num_splits=num_splits)
    assert torch.equal(out, sample_tokens_torch(x, temp, thr, seeds, ctrs))
    assert out[[0, 1, 2, 3, 4, 5, 7]].tolist() == [37, 40, 0, 0, 71, 20, 37] and out[6] >= 64


def test_gumbel_noise_agrees_with_the_kernel_draw():
    """With flat logits the draw is the argmax of the noise alone."""
    R, V = 16, 200
    seeds, ctrs = torch.arange(R, device=DEV) * 7919, torch.arange(R, device=DEV)
    out = sample_tokens(torch.zeros(R, V, device=DEV), torch.ones(R, device=DEV), None, seeds, ctrs, block=64)
    assert torch.equal(out, gumbel_noise(seeds, ctrs, V).argmax(-1))


def test_kernel_draws_follow_the_distribution():
    """Temperature 0.8, top-k 6 and min-p 0.3 (the tighter: 4 tokens kept) on 12 tokens: a chi-square test on 240
    draws."""
    n, V = 240, 12
    logits = torch.tensor([2.0, 1.6, 1.5, 1.0, 0.7, 0.1, 0.0, -0.5, 1.55, -3.0, -1.0, 0.3])
    p = SamplingParams(temperature=0.8, top_k=6, min_p=0.3)
    t = SamplingTensors.build(*_rows([p] * n, list(range(n)), [0] * n), V, DEV)
    x = logits.expand(n, V).contiguous().to(DEV)
    thr = sampling_thresholds(x, t)
    ids = sample_tokens(x, t.temperature, thr, t.seeds, t.counters).cpu()
    probs = torch.softmax(logits / 0.8, -1)
    kept = (logits >= logits.topk(6).values[-1]) & (probs >= 0.3 * probs.max())
    probs = torch.where(kept, probs, 0.0)
    probs /= probs.sum()
    counts = torch.bincount(ids, minlength=V).double()
    assert counts[~kept].sum() == 0
    expected = probs[kept].double() * n
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    dof = int(kept.sum()) - 1
    # P(chi2 > dof + 4 sqrt(2 dof) + 4) is well under 1e-3 for these few degrees of freedom
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 4, (chi2, counts, expected)


@pytest.mark.filterwarnings("ignore:divide by zero")  # log(0) for the all -inf row, under the interpreter
def test_row_logsumexp():
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(2)).to(DEV) * 4
    x[1] = float("-inf")
    x[2, :2500] = float("-inf")
    inv_t = torch.tensor([1.0, 1.0, 0.5, 3.0], device=DEV)
    ref = torch.logsumexp(x * inv_t[:, None], -1)
    torch.testing.assert_close(row_logsumexp(x, inv_t, block=512), ref, rtol=1e-5, atol=1e-5)
    half = x.bfloat16()
    torch.testing.assert_close(
        row_logsumexp(half, inv_t), torch.logsumexp(half.float() * inv_t[:, None], -1), rtol=1e-5, atol=1e-5
    )
