"""Programmatic dependent launch (`heron.kernels.common.pdl_options`): off where it cannot apply and at the
GEMV's sizes, and on a GPU (sm_90+) a chain of kernels that each read the one before (ours and cuBLAS's in
turn) gives, eager and replayed in a CUDA graph, the same bits with it as without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from heron.kernels import common
from heron.kernels.activation import silu_and_mul
from heron.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from tests.kernels.kernel_utils import pick_device

DEVICE = pick_device()
HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) >= (9, 0)


@pytest.fixture
def pdl_env(monkeypatch):
    """Set HERON_PDL for one test; pdl_options re-reads it."""

    def use(value: str) -> None:
        monkeypatch.setenv("HERON_PDL", value)
        common.pdl_supported.cache_clear()

    yield use
    monkeypatch.delenv("HERON_PDL", raising=False)
    common.pdl_supported.cache_clear()


def test_pdl_only_on_hopper_past_the_gemv_sizes(pdl_env):
    pdl_env("1")
    assert common.pdl_options(torch.device("cpu"), 64) == {"PDL": False}
    if DEVICE.type == "cuda":
        assert common.pdl_options(DEVICE, 64)["PDL"] is HOPPER
        assert common.pdl_options(DEVICE, 16) == {"PDL": False}
        pdl_env("0")
        assert common.pdl_options(DEVICE, 64) == {"PDL": False}


def _chain(x, residual, w_up, w_down):
    """Decoder MLPs: each kernel reads what the previous one wrote, ours after cuBLAS's and after our own."""
    ones = lambda n: torch.ones(n, device=x.device, dtype=x.dtype)  # noqa: E731
    for _ in range(4):
        h, residual = fused_add_rms_norm(x, residual, ones(x.shape[1]), 1e-6)
        x = rms_norm(silu_and_mul(h @ w_up.T), ones(w_down.shape[1]), 1e-6) @ w_down.T
    return x.clone(), residual.clone()


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90+ GPU")
@pytest.mark.gpu
def test_pdl_chain_matches_serial_launches(pdl_env):
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2048
    mk = lambda *s: (torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(DEVICE, torch.bfloat16)  # noqa: E731
    x, residual, w_up, w_down = mk(64, hidden), mk(64, hidden), mk(2 * inter, hidden), mk(hidden, inter)
    pdl_env("0")
    want = _chain(x, residual, w_up, w_down)
    pdl_env("1")
    assert common.pdl_options(DEVICE, 64)["PDL"]
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
