import json

import pytest
import torch
import torch.nn.functional as F

from heron.kernels.gemm import cublaslt


def test_table_key_names_the_problem_and_its_types():
    assert cublaslt.table_key(200, 4096, 12288, torch.bfloat16, torch.float32) == "200x4096x12288:bfloat16:float32"


def test_table_keeps_only_this_gpu_models_entries(tmp_path):
    path = tmp_path / "table.json"
    config = {"id": 66, "tile": 20, "splitk": 2}
    path.write_text(
        json.dumps(
            [
                {"device": "GPU A", "cublaslt": 1, "entries": [{"key": "8x16x32:bfloat16:bfloat16", "config": config}]},
                {
                    "device": "GPU B",
                    "cublaslt": 1,
                    "entries": [{"key": "8x16x64:bfloat16:bfloat16", "config": {"id": 1}}],
                },
            ]
        )
    )
    assert cublaslt._table("GPU A", str(path)) == {"8x16x32:bfloat16:bfloat16": config}
    assert cublaslt._table("GPU C", str(path)) == {}
    assert cublaslt._table("GPU A", str(tmp_path / "none.json")) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_searched_configurations_compute_the_product_and_a_table_brings_one_back(monkeypatch):
    dev = torch.device("cuda")
    lt = cublaslt.CublasLt(dev)
    m, n, k = 200, 1024, 2048
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    found = lt.search(m, n, k, torch.bfloat16, torch.bfloat16)
    assert len(found) > len(lt.candidates(m, n, k, torch.bfloat16, torch.bfloat16))  # more than the heuristic's
    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    splits = [c for c in found if lt.config(c)["splitk"] > 1]
    for cand in found[:4] + splits[:4]:
        y.fill_(float("nan"))
        lt.matmul(x, w, y, cand)
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-1)
    config = lt.config(splits[0] if splits else found[-1])
    monkeypatch.setattr(lt, "table", {cublaslt.table_key(m, n, k, torch.bfloat16, torch.bfloat16): config})
    recorded = lt.candidates(m, n, k, torch.bfloat16, torch.bfloat16)[-1]
    assert recorded.rank == -1 and lt.config(recorded) == config
    y.fill_(float("nan"))
    lt.matmul(x, w, y, recorded)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-1)
    monkeypatch.setattr(lt, "table", {cublaslt.table_key(m, n, k, torch.bfloat16, torch.bfloat16): {"id": 10**6}})
    assert all(c.rank >= 0 for c in lt.candidates(m, n, k, torch.bfloat16, torch.bfloat16))  # unknown: skipped
