import math
import time
import weakref

import pytest
import torch
import torch.nn.functional as F

from heron.kernels.gemm import blas, cublaslt, plans, tune
from heron.kernels.gemm.cublaslt import Candidate
from heron.kernels.gemm.plans import MatmulPlans
from heron.layers.linear import ColumnParallelLinear


def _fake_timer(lt_faster: set[tuple[int, int]], cand_times: dict | None = None):
    """A timer where PyTorch's cuBLASLt wins for the (rows, N) pairs listed and candidate calls take
    cand_times[(rows, N)][i] (relative to cuBLAS's 1.0); records what it was asked."""
    asked = []

    def timer(calls, weights, x):
        key = (x.shape[0], weights[0].shape[0])
        asked.append((x.shape[0], tuple(weights[0].shape), len(weights), len(calls)))
        n_libs = 2 if calls[1:2] == [blas.linear_lt] else 1  # (F.linear, cuBLASLt) or the float32 matmul
        libs = ([2.0, 1.0] if key in lt_faster else [1.0, 2.0])[:n_libs]
        extra = list((cand_times or {}).get(key, [3.0] * (len(calls) - n_libs)))
        return [t * len(weights) for t in libs + extra]

    return timer, asked


class _FakeLt:
    """cuBLASLt's interface on the CPU: candidate 1 of each problem writes a wrong product; `searched`: a table's
    configuration follows the heuristic's (rank -1)."""

    def __init__(self, count: int = 3, searched: bool = False):
        self.count, self.searched, self.runs = count, searched, []

    def candidates(self, m, n, k, dtype, out_dtype):
        ranks = list(range(self.count)) + [-1] * self.searched
        return [Candidate(None, 0, i, (m, n, k)) for i in ranks]

    @staticmethod
    def fits(*matrices):
        return all(t.is_contiguous() for t in matrices)

    def matmul(self, x, weight, out, cand):
        self.runs.append((cand.rank, x.shape[0]))
        out.copy_(x @ weight.T + (100.0 if cand.rank == 1 else 0.0))
        return out


def test_tune_writes_each_shape_its_choice_by_row_bucket():
    qkv = [torch.zeros(12, 8) for _ in range(3)]  # three layers' copies of one shape
    down = [torch.zeros(8, 16) for _ in range(3)]
    timer, asked = _fake_timer({(32, 12), (64, 8)})
    found = tune.tune(registry := MatmulPlans(), qkv + down, [64, 32, 64], timer)
    assert sorted(asked) == [(32, (8, 16), 3, 2), (32, (12, 8), 3, 2), (64, (8, 16), 3, 2), (64, (12, 8), 3, 2)]
    assert found[(32, 12, 8, torch.float32)] == (6.0, 3.0, "cublaslt")
    assert found[(32, 8, 16, torch.float32)] == (3.0, 3.0, "cublas")
    plan = registry.get(qkv[1])
    assert plan is registry.get(qkv[0])  # one plan per shape
    # cuBLASLt at 17-32 rows, cuBLAS at 33-64, nothing tuned beyond; no candidates on the CPU
    assert [plan.wants_lt(m) for m in (1, 17, 32, 33, 64, 65, 10_000)] == [True, True, True] + [False] * 4
    assert [registry.get(down[0]).wants_lt(m) for m in (32, 33, 64, 65)] == [False, True, True, False]
    assert plan.candidate(32) is None and plan.candidate(64) is None


def test_tune_picks_a_checked_candidate_only_at_its_row_count_and_past_the_margin(monkeypatch):
    lt = _FakeLt()
    monkeypatch.setattr(cublaslt, "handle", lambda device: lt)  # what tuning and blas_linear run candidates with
    ws = [torch.randn(6, 4) for _ in range(2)]
    # rows 32: candidate 2 is 5% faster than cuBLAS (candidate 1 is faster still, but its product is wrong and
    # it is never timed); rows 64: candidate 0 is only 0.5% faster: a tie, the library stays
    timer, asked = _fake_timer(set(), {(32, 6): [1.2, 0.95], (64, 6): [0.995, 2.0]})
    found = tune.tune(registry := MatmulPlans(), ws, [32, 64], timer)
    assert [a[3] for a in asked] == [4, 4]  # two libraries + the two candidates that passed the check
    plan = registry.get(ws[0])
    assert plan.candidate(32).rank == 2 and plan.candidate(64) is None
    assert plan.candidate(31) is None  # a candidate belongs to its exact problem
    assert found[(32, 6, 4, torch.float32)] == (2.0, 1.9, "candidate")
    assert found[(64, 6, 4, torch.float32)][2] == "cublas"
    lt.runs.clear()
    x = torch.randn(32, 4)
    torch.testing.assert_close(blas.blas_linear(x, ws[1], None, registry), F.linear(x, ws[1]))
    assert lt.runs == [(2, 32)]
    blas.blas_linear(torch.randn(31, 4), ws[1], None, registry)
    blas.blas_linear(x, ws[1], torch.zeros(6), registry)  # a bias: not a candidate's problem
    blas.blas_linear(x, ws[1])  # no registry: untuned
    assert lt.runs == [(2, 32)]


def test_tune_names_a_searched_configuration_that_wins(monkeypatch):
    monkeypatch.setattr(cublaslt, "handle", lambda device: _FakeLt(count=1, searched=True))
    ws = [torch.randn(6, 4)]
    timer, asked = _fake_timer(set(), {(32, 6): [0.9, 0.8], (64, 6): [0.8, 0.9]})
    found = tune.tune(registry := MatmulPlans(), ws, [32, 64], timer)
    plan = registry.get(ws[0])
    assert plan.candidate(32).rank == -1 and found[(32, 6, 4, torch.float32)][2] == "searched"
    assert plan.candidate(64).rank == 0 and found[(64, 6, 4, torch.float32)][2] == "candidate"


def test_tune_float32_out_keeps_its_own_plan(monkeypatch):
    monkeypatch.setattr(cublaslt, "handle", lambda device: _FakeLt(count=1))
    monkeypatch.setattr(tune, "_mm_float32_torch", lambda x, w: (x @ w.T).float())  # (a CUDA-only op)
    head = torch.randn(6, 4)
    timer, asked = _fake_timer(set(), {(32, 6): [0.5]})
    found = tune.tune(registry := MatmulPlans(), [], [32], timer, float32_out=[head])
    assert asked == [(32, (6, 4), 1, 2)]  # PyTorch's float32-output matmul and one candidate
    assert registry.get(head) is None and registry.get(head, float32_out=True).candidate(32).rank == 0
    assert found[(32, 6, 4, torch.float32)] == (1.0, 0.5, "candidate")


def test_copies_pass_the_rotation_bytes_and_times_are_scaled(monkeypatch):
    ws = [torch.zeros(4, 4) for _ in range(10)]  # 64 bytes each
    monkeypatch.setattr(tune, "ROTATE_BYTES", 100)
    timer, asked = _fake_timer(set())
    found = tune.tune(MatmulPlans(), ws, [8], timer)
    assert asked == [(8, (4, 4), 2, 2)]
    assert found[(8, 4, 4, torch.float32)] == (10.0, 10.0, "cublas")  # scaled to all ten copies
    assert len(tune._copies([torch.zeros(1000)] * 3)) == 1  # one copy past the bytes: itself


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


def test_time_on_gpu_times_the_calls_in_turn_and_survives_a_refusal(monkeypatch):
    order = []

    def call(name, sleep=0.0, refuse=False):
        def run(x, w):
            order.append(name)
            if refuse:
                raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
            time.sleep(sleep)
            return x @ w.T

        return run

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    ws = [torch.randn(4, 8) for _ in range(3)]
    t = tune.time_on_gpu([call("a"), call("b", refuse=True), call("c", sleep=0.005)], ws, torch.randn(2, 8), rounds=2)
    # first tries (b refuses), then a and c in turn over the three copies, twice
    assert order == ["a", "b", "c"] + (["a"] * 3 + ["c"] * 3) * 2
    assert t[1] == math.inf and t[2] >= 3 * 0.005 > t[0] >= 0


def test_summary_sums_a_step_per_row_count():
    f32 = torch.float32
    found = {
        (32, 12, 8, f32): (3e-3, 2e-3, "cublaslt"),
        (32, 8, 16, f32): (6e-3, 4e-3, "candidate"),
        (64, 8, 16, f32): (1e-3, 1e-3, "cublas"),
        (64, 12, 8, f32): (2e-3, 1e-3, "searched"),
    }
    line = tune.summary(found, 1.25)
    assert "in 1.2 s over 4 (rows, shape) pairs, chosen: cublas 1, cublaslt 1, candidate 1, searched 1" in line
    assert "32: 9.00 -> 6.00" in line and "64: 3.00 -> 2.00" in line


def test_layers_keep_the_registry_they_were_built_with_and_the_cpu_ignores_its_plans():
    registry = MatmulPlans()
    with plans.use_plans(registry):
        layer = ColumnParallelLinear(4, [6], bias=False)
    assert layer.matmul_plans is registry and ColumnParallelLinear(4, [6], bias=False).matmul_plans is not registry
    w = layer.weight
    torch.nn.init.normal_(w)
    tune.tune(registry, [w], [32], _fake_timer({(32, 6)})[0])
    x = torch.randn(20, 4)
    assert registry.get(w).wants_lt(20)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=0, atol=0)


def test_the_registry_finds_a_weight_by_identity_and_holds_it_weakly():
    w, twin = torch.randn(6, 4), torch.randn(6, 4)
    registry, plan = MatmulPlans(), plans.Plan((32,), (True,), (None,))
    registry.set(w, plan)
    assert registry.get(w) is plan and registry.get(twin) is None and registry.get(w, float32_out=True) is None
    # a new tensor that got a freed weight's id (simulated: its entry moved under the twin's id) finds no plan
    registry._by_id[0][id(twin)] = registry._by_id[0].pop(id(w))
    assert registry.get(twin) is None
    alive = weakref.ref(w)
    del w
    assert alive() is None  # the registry kept no weight alive


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tuned_kernels_on_cuda_match_a_float_reference_also_in_a_graph():
    from heron.kernels.gemm.linear import linear as door

    dev = torch.device("cuda")
    ws = [torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    head = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    registry = MatmulPlans()
    linear = lambda x, w: door(x, w, plans=registry)  # as a layer built with the registry calls it
    mm_float32 = lambda x, w, out=None: blas.mm_float32(x, w, out, registry)
    found = tune.tune(registry, ws, [32, 128, 200], float32_out=[head])
    assert len(found) == 6 and all(t[0] > 0 and 0 < t[1] <= t[0] for t in found.values())
    before = torch.backends.cuda.preferred_blas_library()
    for m in (32, 100, 128, 200):  # 100: the library chosen at 128; the others may run a candidate
        x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        torch.testing.assert_close(linear(x, ws[1]).float(), F.linear(x.float(), ws[1].float()), rtol=2e-2, atol=2e-1)
        torch.testing.assert_close(mm_float32(x, head), x.float() @ head.float().T, rtol=1e-3, atol=1e-2)
        assert torch.backends.cuda.preferred_blas_library() == before
    x = torch.randn(200, 1024, device=dev, dtype=torch.bfloat16)
    logits = torch.empty(256, 4096, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured as a decode graph captures them
        y = linear(x, ws[2])
        mm_float32(y[:, :1024].contiguous(), head, logits[:200])
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref = F.linear(x.float(), ws[2].float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(logits[:200], y[:, :1024].float() @ head.float().T, rtol=1e-3, atol=1e-2)
    odd = [torch.randn(24, 4097, device=dev, dtype=torch.bfloat16)]  # rows 8194 bytes apart: unaligned
    t = tune.time_on_gpu([F.linear, blas.linear_lt], odd, torch.randn(40, 4097, device=dev, dtype=torch.bfloat16))
    assert t[0] > 0 and t[1] > 0  # (inf where cuBLASLt has no kernel for it)
    tune.tune(registry, odd, [40])  # whatever runs an unaligned problem, it is right
    x = torch.randn(40, 4097, device=dev, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, odd[0]).float(), F.linear(x.float(), odd[0].float()), rtol=2e-2, atol=2e-1)
