"""Programmatic dependent launch (`heron.kernels.common.pdl_options`): off where it cannot apply, and on a GPU
(sm_90+) a chain of kernels that each read the one before (ours and cuBLAS's in turn; at one row the GEMVs and
the MoE GEMVs) gives, eager and replayed in a CUDA graph, the same bits with it as without it."""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from triton.runtime.jit import JitFunctionInfo

from heron.kernels import common
from heron.kernels.activation import silu_and_mul
from heron.kernels.gemv import gemv, gemv_rms_norm, gemv_silu_mul
from heron.kernels.moe_gemv import moe_gemv
from heron.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from tests.kernels.kernel_utils import pick_device

DEVICE = pick_device()
HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) >= (9, 0)


@pytest.fixture
def pdl_env(monkeypatch):
    """Set HERON_PDL for one test; pdl_options re-reads it."""

    def use(value: str) -> None:
        monkeypatch.setenv("HERON_PDL", value)
        common._pdl.cache_clear()

    yield use
    monkeypatch.delenv("HERON_PDL", raising=False)
    common._pdl.cache_clear()


def test_pdl_only_on_hopper(pdl_env):
    pdl_env("1")
    assert common.pdl_options(torch.device("cpu"), 64) == {"PDL": False}
    if DEVICE.type == "cuda":
        assert common.pdl_options(DEVICE, 64)["PDL"] is HOPPER
        assert common.pdl_options(DEVICE, 1)["PDL"] is HOPPER
        pdl_env("0")
        assert common.pdl_options(DEVICE, 64) == {"PDL": False}


def _chain(x, residual, w_up, w_down):
    """Decoder MLPs: each kernel reads what the previous one wrote, ours after cuBLAS's and after our own; at
    one row the GEMVs (a norm and the activation in their prologues), a norm kernel, and a MoE layer (router
    GEMV, up and down kernels over 8 experts made of w_up's and w_down's rows)."""
    ones = lambda n: torch.ones(n, device=x.device, dtype=x.dtype)  # noqa: E731
    for _ in range(4):
        if x.shape[0] == 1:
            gate_up, residual = gemv_rms_norm(x, residual, ones(x.shape[1]), 1e-6, w_up)
            x = rms_norm(gemv_silu_mul(gate_up, w_down), ones(w_down.shape[0]), 1e-6)
            w13 = w_up.view(8, -1, w_up.shape[1])
            w2 = w_down.view(w_down.shape[0], 8, -1).transpose(0, 1).contiguous()
            x = moe_gemv(x, gemv(x, w_up[:8]), w13, w2, top_k=2, renormalize=True)
            continue
        h, residual = fused_add_rms_norm(x, residual, ones(x.shape[1]), 1e-6)
        x = rms_norm(silu_and_mul(h @ w_up.T), ones(w_down.shape[1]), 1e-6) @ w_down.T
    return x.clone(), residual.clone()


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90+ GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 1])
def test_pdl_chain_matches_serial_launches(pdl_env, rows):
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2048
    mk = lambda *s: (torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(DEVICE, torch.bfloat16)  # noqa: E731
    x, residual, w_up, w_down = mk(rows, hidden), mk(rows, hidden), mk(2 * inter, hidden), mk(hidden, inter)
    pdl_env("0")
    want = _chain(x, residual, w_up, w_down)
    pdl_env("1")
    assert common.pdl_options(DEVICE, rows)["PDL"]
    assert all(torch.equal(a, b) for a, b in zip(_chain(x, residual, w_up, w_down), want))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _chain(x, residual, w_up, w_down)  # compiled and warm before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            got = _chain(x, residual, w_up, w_down)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@triton.jit
def _fresh_kernel(x_ptr, TAG: tl.constexpr):
    tl.store(x_ptr, TAG)


class _Runner:
    """Stands for a model runner: the start-up's owner."""


def _compile_fresh_kernel() -> None:
    """On a GPU a real compile (a constexpr value no call used before); under the interpreter, which compiles
    nothing, the hook called as Triton calls it."""
    if DEVICE.type == "cuda":
        _fresh_kernel[(1,)](torch.zeros(1, device=DEVICE), TAG=time.time_ns() % 1_000_000)
    else:
        info = JitFunctionInfo(sys.modules[__name__], "_fresh_kernel", _fresh_kernel)
        triton.knobs.runtime.jit_post_compile_hook(
            key="key", repr="", fn=info, compile={}, is_manual_warmup=False, already_compiled=False
        )


def test_a_compile_after_start_up_is_logged_unless_another_start_up_runs(caplog):
    """After a runner's `warn_late_compiles` (its start-up's last call), a kernel Triton compiles is named in a
    warning, but not while another runner of the process starts up (between its `compiles_expected` and its
    own `warn_late_compiles`); a hook set before (a user's) is still called for every compile."""
    saved = triton.knobs.runtime.jit_post_compile_hook
    log = logging.getLogger("heron.test_late_compiles")
    seen = []
    try:
        triton.knobs.runtime.jit_post_compile_hook = lambda **kwargs: seen.append(kwargs["fn"].name)
        first, second = _Runner(), _Runner()
        common.compiles_expected(first)
        common.warn_late_compiles(first, log)
        with caplog.at_level(logging.WARNING, logger=log.name):
            common.compiles_expected(second)
            _compile_fresh_kernel()
            assert "after start-up" not in caplog.text
            common.warn_late_compiles(second, log)
            common.warn_late_compiles(first, log)  # again: one hook, one warning per compile
            _compile_fresh_kernel()
        assert caplog.text.count("Triton compiled _fresh_kernel after start-up") == 1
        assert seen == ["_fresh_kernel"] * 2
    finally:
        triton.knobs.runtime.jit_post_compile_hook = saved
