"""The decode GEMV against F.linear in float32. On CPU it runs under Triton's interpreter with small shapes
(N, K not multiples of the blocks, both inner products, split-K with an empty last split); the `gpu` cases
(model shapes, the default configs, `layers.linear`'s dispatch, CUDA-graph replay) run only on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from heron.kernels.gemv import (
    GemvConfig,
    _gemv_kernel,
    gemv,
    gemv_rms_norm,
    gemv_silu_mul,
    make_workspace,
    pick_config,
    use_gemv,
)
from heron.kernels.reference import rms_norm_ref, silu_and_mul_ref
from tests.kernels.kernel_utils import pick_device, random_adapters, rel_err, skip_unless_runnable

DEVICE = pick_device()
ON_GPU = DEVICE.type == "cuda"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

skip_unless_runnable(_gemv_kernel, DEVICE)

# dtype -> (relative Frobenius error, max abs error relative to max |reference|): bf16 is one rounding of the
# output (2^-9) plus float32 sums in another order.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4e-3, 8e-3)}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, what: str) -> None:
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.shape == ref.shape and out.dtype == x.dtype, f"{what}: {tuple(out.shape)} {out.dtype}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element left unwritten?)"
    rel_tol, abs_tol = TOL[x.dtype]
    err = rel_err(out, ref)
    assert err < rel_tol, f"{what}: relative error {err:.3g} >= {rel_tol}"
    max_abs = (out.float() - ref).abs().max().item()
    assert max_abs <= abs_tol * ref.abs().max().item(), f"{what}: max abs error {max_abs:.3g}"


# Small blocks so that N = 100, K = 200 leave partial tiles; split 3 of 4 K-tiles leaves the last split empty.
CASES = [
    GemvConfig(32, 64),
    GemvConfig(32, 64, split_k=3),
    GemvConfig(16, 64, split_k=2, dot=False),
    GemvConfig(16, 32, dot=False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,cfg",
    [(m, c) for m in (1, 3, 8, 16) for c in CASES if c.dot or m == 1],
    ids=lambda v: f"{'dot' if v.dot else 'fma'}-split{v.split_k}" if isinstance(v, GemvConfig) else f"m{v}",
)
def test_gemv(dtype, m, cfg):
    for bias in (False, True):
        x, w, b = _inputs(m, 100, 200, dtype, seed=m * 10 + bias, bias=bias)
        out = torch.full((m, 100), float("nan"), dtype=dtype, device=DEVICE)
        _check(gemv(x, w, b, out, config=cfg), x, w, b, f"{cfg} bias={bias}")


def test_split_k_counters_reset_and_sums_are_deterministic():
    """The last split leaves the arrival counters at zero, so repeated calls with one workspace are equal."""
    x, w, b = _inputs(5, 70, 256, torch.bfloat16, seed=3)
    ws = make_workspace(partials=3 * 16 * 96, tiles=3, device=DEVICE)
    cfg = GemvConfig(32, 64, split_k=3)
    first = gemv(x, w, b, config=cfg, workspace=ws)
    assert torch.count_nonzero(ws[1]) == 0
    assert torch.equal(gemv(x, w, b, config=cfg, workspace=ws), first)
    _check(first, x, w, b, "split-K with a passed workspace")


def test_default_config_and_strided_rows():
    """The default rule (odd N and K, unaligned K) on a row-strided x and 3-D x."""
    for m, n, k in [(1, 45, 100), (7, 130, 72)]:
        x, w, b = _inputs(m, n, k + 8, torch.float32, seed=n)
        x, w = x[:, :k], w[:, :k].contiguous()
        assert use_gemv(x, w, b) == ON_GPU
        _check(gemv(x, w, b), x, w, b, f"default {pick_config(m, n, k, x.dtype, x.device)}")
    x, w, _ = _inputs(6, 40, 64, torch.bfloat16, seed=1, bias=False)
    _check(gemv(x.view(2, 3, 64), w).view(6, 40), x, w, None, "3-D x")


def test_use_gemv_refuses_what_it_does_not_take():
    x, w, b = _inputs(4, 32, 64, torch.bfloat16, seed=2)
    if not ON_GPU:
        assert not use_gemv(x, w, b)
        return
    assert use_gemv(x, w, b)
    big = torch.zeros(17, 64, dtype=x.dtype, device=DEVICE)
    assert not use_gemv(big, w)
    assert not use_gemv(x, w.t().contiguous().t())  # not contiguous
    assert not use_gemv(x.float(), w)  # dtype mismatch
    assert not use_gemv(x[:, ::2], w[:, :32].contiguous())  # strided columns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,cfg",
    [
        (1, GemvConfig(16, 64, split_k=2, dot=False)),
        (1, GemvConfig(32, 64)),
        (5, GemvConfig(32, 64, split_k=3)),
        (16, GemvConfig(16, 32)),
    ],
    ids=["fma-split2", "dot-m1", "dot-split3", "dot-m16"],
)
def test_silu_mul_prologue(dtype, m, cfg):
    """silu(gate) * up taken on load equals the activation kernel's reference then the GEMV."""
    gen = torch.Generator().manual_seed(m)
    gate_up = torch.randn(m, 2 * 200, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(100, 200, generator=gen) / 200**0.5).to(DEVICE, dtype)
    act = silu_and_mul_ref(gate_up)  # rounded to dtype, as the prologue rounds it
    _check(gemv_silu_mul(gate_up, w, config=cfg), act, w, None, f"silu_mul {cfg}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,cfg",
    [
        (1, GemvConfig(16, 64, split_k=2, dot=False)),
        (1, GemvConfig(16, 32, dot=False)),
        (3, GemvConfig(32, 64, split_k=3)),
        (16, GemvConfig(16, 32)),
    ],
    ids=["fma-split2", "fma", "dot-split3", "dot-m16"],
)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_prologue(dtype, m, cfg, with_residual):
    """RMSNorm (after the residual add) taken on load: the projection of the reference's normalised rows, and
    the new residual equal to x + residual exactly."""
    gen = torch.Generator().manual_seed(m + 7 * with_residual)
    x = torch.randn(m, 200, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(m, 200, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(200, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(100, 200, generator=gen) / 200**0.5).to(DEVICE, dtype)
    b = torch.randn(100, generator=gen).to(DEVICE, dtype)
    y, new_residual = gemv_rms_norm(x, residual, norm_w, 1e-6, w, b, config=cfg)
    ref = rms_norm_ref(x, norm_w, 1e-6, residual)
    normed, ref_residual = ref if with_residual else (ref, x)
    assert torch.equal(new_residual, ref_residual)
    _check(y, normed, w, b, f"rms_norm {cfg} residual={with_residual}")


def _fp8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8 weight with per-row scales of different magnitudes (heron/kernels/gemm/fp8.py's layout)."""
    from heron.kernels.gemm.fp8 import quantize_fp8_rows_ref

    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    wq, scale = quantize_fp8_rows_ref(w)
    return wq.to(DEVICE), scale.to(DEVICE)


FP8_CASES = [
    (1, GemvConfig(16, 64, split_k=2, dot=False)),
    (1, GemvConfig(32, 64)),
    (5, GemvConfig(32, 64, split_k=3)),
    (16, GemvConfig(16, 32)),
]


@pytest.mark.parametrize("m,cfg", FP8_CASES, ids=["fma-split2", "dot-m1", "dot-split3", "dot-m16"])
@pytest.mark.parametrize("prologue", ["none", "silu_mul", "rms_norm"])
def test_fp8_weights(m, cfg, prologue):
    """A float8 weight (W8A16) with each prologue equals F.linear of x (after the prologue's reference) with
    the dequantized weight: each row's scale applied once, after the split-K partials are summed."""
    gen = torch.Generator().manual_seed(m)
    wq, scale = _fp8_weight(100, 200, gen)
    w = wq.float() * scale  # what the product must use
    x = torch.randn(m, 400 if prologue == "silu_mul" else 200, generator=gen).to(DEVICE, torch.bfloat16)
    b = torch.randn(100, generator=gen).to(DEVICE, torch.bfloat16)
    if prologue == "none":
        got, x_in = gemv(x, wq, b, config=cfg, weight_scale=scale), x
    elif prologue == "silu_mul":
        got, x_in = gemv_silu_mul(x, wq, b, config=cfg, weight_scale=scale), silu_and_mul_ref(x)
    else:
        norm_w = (1 + 0.1 * torch.randn(200, generator=gen)).to(DEVICE, torch.bfloat16)
        got, _ = gemv_rms_norm(x, None, norm_w, 1e-6, wq, b, config=cfg, weight_scale=scale)
        x_in = rms_norm_ref(x, norm_w, 1e-6)
    _check(got, x_in, w, b, f"fp8 {prologue} {cfg}")


def _adapters(slots: int, sizes: list[int], rank: int, k: int, gen: torch.Generator):
    """`slots` adapters of full rank for a projection of parts `sizes`, in bf16 on DEVICE."""
    a, b = random_adapters(slots, k, sizes, rank, [rank] * slots, gen)
    return a.to(DEVICE, torch.bfloat16), b.to(DEVICE, torch.bfloat16)


def _mapping(slots: list[int], num_slots: int) -> list[torch.Tensor]:
    """The rows' slots and their grouping by slot (token_slots, sorted_tokens, slot_start) on DEVICE."""
    from heron.executor.lora_manager import group_by_slot

    order, starts = group_by_slot(np.array(slots), num_slots)
    return [t.to(DEVICE) for t in (torch.tensor(slots), torch.from_numpy(order), torch.from_numpy(starts))]


LORA_CASES = [  # (rows, config, prologue, the rows' slots, a float8 weight, the door's LoRAWeights.for_gemv)
    (1, GemvConfig(16, 64, dot=False), "none", [1], False, False),  # 16-column tiles across both part boundaries
    (1, GemvConfig(16, 64, split_k=2, dot=False), "silu_mul", [0], False, False),  # the last split's epilogue
    (1, GemvConfig(16, 32, dot=False), "rms_norm", [2], False, False),
    (1, GemvConfig(16, 32, dot=False), "rms_norm_residual", [1], True, False),
    (1, GemvConfig(16, 64, dot=False), "none", [-1], False, False),  # the base model's row: nothing added
    (3, GemvConfig(32, 64, split_k=3), "rms_norm_residual", [1, -1, 0], False, False),  # the expand kernel after
    # the A rows in the GEMV's own grid (`LoRARows`: 12 rows, one tile or two)
    (1, GemvConfig(16, 64, dot=False), "none", [1], False, True),
    (1, GemvConfig(8, 64, split_k=2, dot=False), "silu_mul", [0], False, True),  # A tiles split too
    (1, GemvConfig(16, 32, dot=False), "rms_norm_residual", [2], False, True),  # h stored by W's first tile
    (1, GemvConfig(16, 64, dot=False), "rms_norm", [-1], False, True),  # no adapter: the A tiles return at once
    (1, GemvConfig(16, 32, dot=False), "rms_norm_residual", [1], True, True),  # float8: the shrink kernel first
    (1, GemvConfig(16, 64), "none", [1], False, True),  # a forced tensor-core config: the shrink kernel first
    (1, GemvConfig(2, 64, dot=False), "rms_norm", [0], False, True),  # 50 weight tiles: more than counter groups
]


@pytest.mark.parametrize("m,cfg,prologue,slots,fp8,door", LORA_CASES)
def test_lora_delta_in_the_epilogue(m, cfg, prologue, slots, fp8, door, monkeypatch):
    """A projection plus its LoRA delta (heron/kernels/lora.py's shrink, over the same prologue's input) equals
    F.linear plus the dense reference's delta; one row on the FMA path adds it in the GEMV's epilogue (the
    expand kernel never runs), more rows run the expand after. Through the door (`for_gemv`), a one-row GEMV of
    a 16-bit weight computes the shrink itself: the shrink kernel never runs either."""
    from heron.kernels.lora import LoRADelta, LoRAWeights, lora_shrink
    from heron.kernels.reference import lora_ref

    gen = torch.Generator().manual_seed(m + len(prologue))
    sizes, rank, k = [40, 24, 36], 4, 200
    a, lb = _adapters(3, sizes, rank, k, gen)
    token_slots = torch.tensor(slots)
    mapping = _mapping(slots, 3)
    if fp8:
        wq, scale = _fp8_weight(100, k, gen)
        w = wq.float() * scale
    else:
        wq, scale = (torch.randn(100, k, generator=gen) / k**0.5).to(DEVICE, torch.bfloat16), None
        w = wq
    x = torch.randn(m, 2 * k if prologue == "silu_mul" else k, generator=gen).to(DEVICE, torch.bfloat16)
    residual = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, torch.bfloat16)
    b = torch.randn(100, generator=gen).to(DEVICE, torch.bfloat16)
    shrink = {}
    if prologue == "silu_mul":
        shrink, u = {"act": "silu"}, silu_and_mul_ref(x)
    elif prologue.startswith("rms_norm"):
        res = residual if prologue.endswith("residual") else None
        shrink = {"norm": (norm_w, 1e-6), "residual": res}
        u = rms_norm_ref(x, norm_w, 1e-6, res)[0] if res is not None else rms_norm_ref(x, norm_w, 1e-6)
    else:
        u = x
    if door:
        delta = LoRAWeights(a, lb, *mapping, sizes, rank).for_gemv(x, wq, **shrink)
        if not fp8 and not cfg.dot:
            monkeypatch.setattr(LoRAWeights, "shrink", lambda *_, **__: pytest.fail("the shrink kernel ran"))
    else:
        delta = lora_shrink(x, a, lb, *mapping, sizes, rank, 2, **shrink)
    if m == 1 and not cfg.dot:
        monkeypatch.setattr(LoRADelta, "add_to_", lambda *_: pytest.fail("the expand kernel ran at one row"))
    if prologue == "silu_mul":
        got = gemv_silu_mul(x, wq, b, config=cfg, weight_scale=scale, lora=delta)
    elif prologue.startswith("rms_norm"):
        got, h = gemv_rms_norm(x, shrink["residual"], norm_w, 1e-6, wq, b, config=cfg, weight_scale=scale, lora=delta)
        if shrink["residual"] is not None:
            assert torch.equal(h, x + residual)
    else:
        got = gemv(x, wq, b, config=cfg, weight_scale=scale, lora=delta)
    want = torch.nn.functional.linear(u.float(), w.float(), b.float())
    want += lora_ref(u.float(), a.float(), lb.float(), token_slots.to(DEVICE))
    assert rel_err(got, want) < 1e-2, f"{prologue} {cfg}"
    if door:  # every counter the GEMV used is left zeroed for the next call (a CUDA graph's replay)
        from heron.kernels import gemv as gemv_module

        assert all(not ws[1].any() for ws in gemv_module._shared.values())
    plain = torch.nn.functional.linear(u.float(), w.float(), b.float())
    for row in (token_slots < 0).nonzero().flatten().tolist():  # the base model's rows: nothing added
        assert rel_err(got[row], plain[row]) < 1e-2


def test_use_gemv_takes_fp8_weights_with_their_scales_only():
    wq, scale = _fp8_weight(32, 64, torch.Generator().manual_seed(0))
    x = torch.randn(4, 64).to(DEVICE, torch.bfloat16)
    assert use_gemv(x, wq, weight_scale=scale) == ON_GPU
    assert not use_gemv(x, wq)  # a float8 weight needs its scales
    assert not use_gemv(x, wq, weight_scale=scale[:16])
    assert not use_gemv(x, wq.float(), weight_scale=scale)  # scales go with a float8 weight only


# -- GPU only ---------------------------------------------------------------------------------------------------

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (4096, 14336)]


@gpu_only
@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_model_shapes_default_configs(m):
    for n, k in SHAPES:
        x, w, b = _inputs(m, n, k, torch.bfloat16, seed=n + k, bias=n == 4096)
        _check(gemv(x, w, b), x, w, b, f"{m}x{n}x{k} {pick_config(m, n, k, x.dtype, x.device)}")


@gpu_only
def test_linear_dispatch():
    from heron.kernels.gemm.linear import linear

    x, w, b = _inputs(8, 1024, 2048, torch.bfloat16, seed=5)
    _check(linear(x, w, b), x, w, b, "linear -> gemv")
    xl = torch.randn(40, 2048, device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(linear(xl, w, b), torch.nn.functional.linear(xl, w, b))


@gpu_only
def test_cuda_graph_replay():
    """Capture split-K and plain GEMVs once, change x in place, replay: the same as eager calls."""
    x, w, b = _inputs(4, 1024, 3072, torch.bfloat16, seed=9)
    w2 = _inputs(4, 6144, 3072, torch.bfloat16, seed=10)[1]
    split = GemvConfig(64, 128, split_k=8)

    def step():
        return gemv(x, w, b, config=split), gemv(x, w2)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, step()):
            assert torch.equal(got, want)
    _check(captured[0], x, w, b, "replayed split-K")


@gpu_only
def test_lora_one_row_graph_replay():
    """Batch-1 projections with an adapter at Qwen3-8B's qkv and o shapes, chained (the o projection reads the
    qkv one's output, each GEMV adds its delta in the epilogue): captured once, replayed with new inputs and
    slots, equal to eager calls and to F.linear plus the dense reference's delta."""
    from heron.kernels.gemm.linear import linear
    from heron.kernels.lora import LoRAWeights
    from heron.kernels.reference import lora_ref

    gen = torch.Generator().manual_seed(11)
    k, rank, num_slots = 4096, 16, 3
    qkv_sizes = [4096, 1024, 1024]
    w_qkv = (torch.randn(sum(qkv_sizes), k, generator=gen) / k**0.5).to(DEVICE, torch.bfloat16)
    w_o = (torch.randn(k, k, generator=gen) / k**0.5).to(DEVICE, torch.bfloat16)
    a_qkv, b_qkv = _adapters(num_slots, qkv_sizes, rank, k, gen)
    a_o, b_o = _adapters(num_slots, [k], rank, k, gen)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    mapping = _mapping([1], num_slots)
    lora_qkv = LoRAWeights(a_qkv, b_qkv, *mapping, qkv_sizes, rank)
    lora_o = LoRAWeights(a_o, b_o, *mapping, [k], rank)

    def step():
        qkv = linear(x, w_qkv, lora=lora_qkv)
        return qkv, linear(qkv[:, :k], w_o, lora=lora_o)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for slot in (2, -1, 0):
        x.copy_(torch.randn_like(x))
        for live, new in zip(mapping, _mapping([slot], num_slots)):
            live[: new.numel()].copy_(new)  # (a row without an adapter is in no slot's run)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, step()):
            assert torch.equal(got, want), f"slot {slot}: replay != eager"
        qkv, o = captured
        delta = lora_ref(x.float(), a_qkv.float(), b_qkv.float(), mapping[0])
        assert rel_err(qkv, torch.nn.functional.linear(x.float(), w_qkv.float()) + delta) < 1e-2, f"slot {slot}: qkv"
        u = qkv[:, :k].float()
        delta = lora_ref(u, a_o.float(), b_o.float(), mapping[0])
        assert rel_err(o, torch.nn.functional.linear(u, w_o.float()) + delta) < 1e-2, f"slot {slot}: o"
