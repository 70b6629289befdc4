"""Programmatic dependent launch (`heron.kernels.common.pdl_options`): off where it cannot apply, and on a GPU
(sm_90+) a chain of kernels that each read the one before gives, eager and replayed in a CUDA graph, the same
bits with it as without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_utils import pick_device

from heron.kernels import common
from heron.kernels.activation import silu_and_mul
from heron.kernels.gemv import gemv, gemv_rms_norm, gemv_silu_mul
from heron.kernels.rmsnorm import fused_add_rms_norm

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


def test_pdl_off_without_a_hopper_gpu(pdl_env):
    pdl_env("1")
    assert common.pdl_options(torch.device("cpu")) == {"PDL": False}
    if DEVICE.type == "cuda":
        assert common.pdl_options(DEVICE)["PDL"] is HOPPER
        pdl_env("0")
        assert common.pdl_options(DEVICE) == {"PDL": False}


def _chain(x, residual, w_up, w_down, norm_w):
    """A decoder MLP at decode size on our kernels only: each kernel reads what the previous one wrote."""
    for _ in range(4):
        h, residual = fused_add_rms_norm(x, residual, norm_w, 1e-6)
        x = gemv(silu_and_mul(gemv(h, w_up)), w_down)
        up, _ = gemv_rms_norm(x, None, norm_w, 1e-6, w_up)
        x = gemv_silu_mul(up, w_down)
    return x.clone(), residual.clone()


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90+ GPU")
@pytest.mark.gpu
def test_pdl_chain_matches_serial_launches(pdl_env):
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2048
    mk = lambda *s: (torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(DEVICE, torch.bfloat16)  # noqa: E731
    x, residual, w_up, w_down = mk(4, hidden), mk(4, hidden), mk(2 * inter, hidden), mk(hidden, inter)
    norm_w = torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16)
    pdl_env("0")
    want = _chain(x, residual, w_up, w_down, norm_w)
    pdl_env("1")
    assert common.pdl_options(DEVICE)["PDL"]
    assert all(torch.equal(a, b) for a, b in zip(_chain(x, residual, w_up, w_down, norm_w), want))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _chain(x, residual, w_up, w_down, norm_w)  # compiled and warm before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            got = _chain(x, residual, w_up, w_down, norm_w)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
