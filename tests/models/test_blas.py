import time

import pytest
import torch
import torch.nn.functional as F

from heron.models import blas
from heron.models.layers import linear


def _fake_timer(lt_faster: set[tuple[int, int]]):
    """A timer where cuBLASLt wins for the (rows, N) pairs listed; records what it was asked."""
    calls = []

    def timer(weights, x):
        calls.append((x.shape[0], tuple(weights[0].shape), len(weights)))
        lt = (x.shape[0], weights[0].shape[0]) in lt_faster
        return (2.0 * len(weights), len(weights)) if lt else (len(weights), 2.0 * len(weights))

    return timer, calls


def test_tune_writes_each_shape_its_choice_by_row_bucket():
    qkv = [torch.zeros(12, 8) for _ in range(3)]  # three layers' copies of one shape
    down = [torch.zeros(8, 16) for _ in range(3)]
    timer, calls = _fake_timer({(32, 12), (64, 8)})
    found = blas.tune(qkv + down, [64, 32, 64], timer)
    assert sorted(calls) == [(32, (8, 16), 3), (32, (12, 8), 3), (64, (8, 16), 3), (64, (12, 8), 3)]
    assert found[(32, 12, 8)] == (6.0, 3.0) and found[(32, 8, 16)] == (3.0, 6.0)
    for w in qkv:  # cuBLASLt at 17-32 rows, cuBLAS at 33-64, nothing tuned beyond
        assert [blas.wants_lt(w, m) for m in (1, 17, 32, 33, 64, 65, 10_000)] == [True, True, True, False, False,
                                                                                  False, False]
    assert [blas.wants_lt(down[0], m) for m in (32, 33, 64, 65)] == [False, True, True, False]
    assert not blas.wants_lt(torch.zeros(12, 8), 32)  # an untuned weight


def test_large_row_counts_are_timed_over_a_few_copies_and_scaled():
    ws = [torch.zeros(4, 4) for _ in range(10)]
    timer, calls = _fake_timer(set())
    found = blas.tune(ws, [blas.ROTATE_MAX_ROWS + 1], timer)
    assert calls == [(blas.ROTATE_MAX_ROWS + 1, (4, 4), blas.LARGE_COPIES)]
    assert found[(blas.ROTATE_MAX_ROWS + 1, 4, 4)] == (10.0, 20.0)  # scaled to all ten copies


class _FakeEvent:
    """torch.cuda.Event on the host clock: what time_on_gpu's control flow needs, without a GPU."""

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("lt_refuses", [False, True])
def test_time_on_gpu_times_both_libraries_in_turn_and_survives_a_refusal(monkeypatch, lt_refuses):
    calls = []

    def fake_lt(x, w, b=None):
        calls.append("lt")
        if lt_refuses:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        time.sleep(0.005)  # cuBLASLt "slower" here
        return x @ w.T

    def fake_default(x, w, b=None):
        calls.append("default")
        return x @ w.T

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(blas, "linear_lt", fake_lt)
    monkeypatch.setattr(blas.F, "linear", fake_default)
    ws = [torch.randn(4, 8) for _ in range(3)]
    t_default, t_lt = blas.time_on_gpu(ws, torch.randn(2, 8), rounds=2)
    if lt_refuses:  # one refused try, then the default alone: a warm-up and 2 rounds over the 3 copies
        assert calls == ["default", "lt"] + ["default"] * 6 and t_lt == float("inf") and t_default >= 0
    else:  # warm-ups, then default and cuBLASLt in turn
        assert calls == ["default", "lt"] + (["default"] * 3 + ["lt"] * 3) * 2
        assert t_lt >= 3 * 0.005 > t_default


def test_summary_sums_a_step_per_row_count():
    found = {(32, 12, 8): (3e-3, 6e-3), (32, 8, 16): (6e-3, 3e-3), (64, 8, 16): (1e-3, 1e-3)}
    line = blas.summary(found, 1.25)
    assert "in 1.2 s: cuBLASLt for 1 of 3" in line
    assert "32: 9.00 -> 6.00" in line and "64: 1.00 -> 1.00" in line


def test_linear_on_cpu_ignores_a_plan():
    w = torch.randn(6, 4)
    blas.tune([w], [32], _fake_timer({(32, 6)})[0])
    x = torch.randn(20, 4)
    assert blas.wants_lt(w, 20)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cublaslt_choice_on_cuda_matches_cublas_and_restores_the_preference():
    dev = torch.device("cuda")
    ws = [torch.randn(256, 512, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    found = blas.tune(ws, [32, 128])
    assert set(found) == {(32, 256, 512), (128, 256, 512)} and all(min(t) > 0 for t in found.values())
    before = torch.backends.cuda.preferred_blas_library()
    x = torch.randn(100, 512, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x.float(), ws[0].float())
    got = blas.linear_lt(x, ws[0])
    assert torch.backends.cuda.preferred_blas_library() == before
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(linear(x, ws[0]).float(), ref, rtol=2e-2, atol=2e-2)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):  # captured as a decode graph captures it
        out = blas.linear_lt(x, ws[1])
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.float(), F.linear(x.float(), ws[1].float()), rtol=2e-2, atol=2e-2)
    odd = [torch.randn(24, 4097, device=dev, dtype=torch.bfloat16)]  # rows 8194 bytes apart: unaligned
    t_default, t_lt = blas.time_on_gpu(odd, torch.randn(40, 4097, device=dev, dtype=torch.bfloat16))
    assert t_default > 0 and t_lt > 0  # (inf where cuBLASLt has no kernel for it)
