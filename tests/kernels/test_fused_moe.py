"""The fused MoE kernels against their PyTorch references (heron/kernels/reference.py). On CPU they run under
Triton's interpreter with tiny shapes (few experts, partial tiles, K not a multiple of BLOCK_K, routings that
crowd one expert and leave others empty); the `gpu` cases (Qwen3-30B-A3B's shapes with the default configs,
CUDA-graph replay of a decode step under new routings) run only on CUDA."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from heron.kernels.fused_moe import (
    MoeGemmConfig,
    _fused_moe_kernel,
    fused_experts,
    fused_moe,
    max_padded_slots,
    moe_align_block_size,
    per_entry,
    pick_config,
)
from heron.kernels.moe_routing import topk_softmax
from heron.kernels.reference import fused_experts_ref, fused_moe_ref
from tests.kernels.kernel_utils import pick_device, rel_err, skip_unless_runnable

DEVICE = pick_device()
ON_GPU = DEVICE.type == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

skip_unless_runnable(_fused_moe_kernel, DEVICE)

# dtype -> (relative Frobenius error, max abs error relative to max |reference|): the kernel rounds where the
# reference does, so bf16 differs only where a float32 sum in another order rounds to the next bf16 value.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4e-3, 8e-3)}


def _skewed_ids(tokens: int, top_k: int, num_experts: int, empty: set[int], gen: torch.Generator) -> torch.Tensor:
    """k distinct experts per token, most tokens on expert 0 (several blocks of it), none on `empty`."""
    weights = torch.ones(num_experts)
    weights[0] = 4.0 * num_experts
    weights[list(empty)] = 0.0
    return torch.stack([torch.multinomial(weights, top_k, generator=gen) for _ in range(tokens)]).to(torch.int32)


@pytest.mark.parametrize("tokens, top_k, block_m", [(1, 2, 16), (37, 3, 16), (70, 2, 32)])
def test_alignment_sorts_entries_by_expert_in_padded_runs(tokens, top_k, block_m):
    num_experts, empty = 7, {2, 5}
    ids = _skewed_ids(tokens, top_k, num_experts, empty, torch.Generator().manual_seed(tokens))
    sorted_ids, expert_ids, total = (t.cpu() for t in moe_align_block_size(ids.to(DEVICE), block_m, num_experts))
    flat, n = ids.flatten(), ids.numel()
    counts = torch.bincount(flat.long(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert total.item() == padded.sum().item() <= max_padded_slots(n, num_experts, block_m) == len(sorted_ids)
    start = 0
    for e in range(num_experts):  # each expert's run: its entries (in any order), then padding
        run = sorted_ids[start : start + padded[e]]
        assert sorted(run[: counts[e]].tolist()) == (flat == e).nonzero().flatten().tolist()
        assert (run[counts[e] :] == n).all()
        assert (expert_ids[start // block_m : (start + padded[e]) // block_m] == e).all()
        start += padded[e].item()
    assert (expert_ids[start // block_m :] == -1).all()


CASES = {  # (tokens, hidden, inter, experts, top_k, config): partial N tiles (inter 40), K 48 not a multiple of 32
    "decode-1": (1, 64, 40, 6, 2, MoeGemmConfig(16, 16, 32)),
    "per-entry": (2, 48, 40, 16, 2, MoeGemmConfig(16, 16, 32)),  # no sorting: a block per (token, expert)
    "uneven": (23, 48, 40, 6, 2, MoeGemmConfig(16, 16, 32, group_m=2)),
    "block-32": (12, 64, 32, 4, 3, MoeGemmConfig(32, 32, 16)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_experts_matches_the_reference(dtype, case):
    tokens, hidden, inter, num_experts, top_k, cfg = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    ids = _skewed_ids(tokens, top_k, num_experts, {1, num_experts - 1}, gen).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    out = fused_experts(x, w13, w2, weights, ids, config=cfg)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    _check(out, ref, f"{case} {dtype}")


def test_no_tokens_give_an_empty_output():
    x = torch.zeros(0, 32, device=DEVICE)
    w13, w2 = torch.zeros(4, 32, 32, device=DEVICE), torch.zeros(4, 32, 16, device=DEVICE)
    weights, ids = topk_softmax(torch.zeros(0, 4, device=DEVICE), 2, True)
    assert fused_experts(x, w13, w2, weights, ids).shape == (0, 32)


def test_only_batches_that_rarely_share_an_expert_skip_the_sorting():
    assert per_entry(2, 16, 2) and not per_entry(1, 6, 2) and not per_entry(23, 6, 2)
    assert per_entry(4, 128, 8) and not per_entry(5, 128, 8)  # Qwen3-30B-A3B: decode batches of up to 4


def test_pick_config_fits_an_experts_decode_entries_in_one_block():
    assert pick_config(1, 128, 768, 2048, 8, torch.bfloat16).block_m == 16
    assert pick_config(64, 128, 768, 2048, 8, torch.bfloat16).block_m == 16  # 4 entries per expert
    assert pick_config(256, 128, 768, 2048, 8, torch.bfloat16).block_m == 32  # 16 entries per expert
    assert pick_config(8192, 128, 768, 2048, 8, torch.bfloat16).block_m == 64


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{what}: {tuple(out.shape)} {out.dtype}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (a row left unwritten?)"
    rel_tol, abs_tol = TOL[ref.dtype]
    err = rel_err(out, ref)
    assert err < rel_tol, f"{what}: relative error {err:.3g} >= {rel_tol}"
    max_abs = (out.float() - ref.float()).abs().max().item()
    assert max_abs <= abs_tol * ref.float().abs().max().item(), f"{what}: max abs error {max_abs:.3g}"


def _qwen3_30b_experts(gen: torch.Generator, num_experts: int = 128, hidden: int = 2048, inter: int = 768):
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, torch.bfloat16)
    return w13, w2


@gpu_only
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_qwen3_30b_shapes_with_the_default_configs(tokens):
    gen = torch.Generator().manual_seed(tokens)
    w13, w2 = _qwen3_30b_experts(gen)
    x = torch.randn(tokens, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    logits = torch.randn(tokens, 128, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = topk_softmax(logits, 8, renormalize=True)
    _check(fused_experts(x, w13, w2, weights, ids), fused_experts_ref(x, w13, w2, weights, ids), f"T={tokens}")


@gpu_only
@pytest.mark.parametrize("tokens", [1, 8])  # the GEMVs (heron/kernels/moe_gemv.py); sorted
def test_a_captured_decode_step_replays_under_new_routings(tokens):
    """The graph holds no routing: each replay routes the entries it is given (a new expert set, a crowded
    expert), with nothing read back to the host."""
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _qwen3_30b_experts(gen)
    x = torch.randn(tokens, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    logits = torch.randn(tokens, 128, generator=gen).to(DEVICE, torch.bfloat16)

    def step() -> torch.Tensor:
        return fused_moe(x, logits, w13, w2, 8, renormalize=True)

    step()  # compile eagerly first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for crowd in (False, True):
        logits.copy_(torch.randn(tokens, 128, generator=gen))
        if crowd:
            logits[:, :8] += 20.0  # every token on experts 0..7
        graph.replay()
        _check(out, fused_moe_ref(x, logits, w13, w2, 8, renormalize=True), f"replay crowd={crowd}")
