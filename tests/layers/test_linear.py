"""The tensor-parallel layers: at world size 1 the plain ops in the same shapes; across two gloo ranks,
loading slices of full tensors and computing what the full layer computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heron.distributed import destroy_distributed, init_distributed, parallel_state
from heron.layers.linear import ColumnParallelLinear, RowParallelLinear
from heron.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


def test_at_world_size_1_each_layer_is_the_plain_op_in_the_full_shape():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 16), torch.randn(12, 16), torch.randn(12)
    col = ColumnParallelLinear(16, [8, 4], bias=True)
    col.weight_loader(col.weight, w[:8], 0)
    col.weight_loader(col.weight, w[8:], 1)
    col.weight_loader(col.bias, b[:8], 0)
    col.weight_loader(col.bias, b[8:], 1)
    assert torch.equal(col(x), F.linear(x, w, b))
    row = RowParallelLinear(16, 12, bias=True)
    row.weight_loader(row.weight, w)
    row.weight_loader(row.bias, b)
    assert torch.equal(row(x), F.linear(x, w, b))
    emb, head = VocabParallelEmbedding(12, 16), ParallelLMHead(12, 16)
    emb.weight_loader(emb.weight, w)
    head.weight = emb.weight
    ids = torch.tensor([0, 11, 5])
    assert torch.equal(emb(ids), F.embedding(ids, w))
    assert torch.equal(head(x), F.linear(x, w))
    assert [p.shape for p in (col.weight, row.weight, emb.weight)] == [w.shape] * 3


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("rows", [3, 40])  # on CUDA: the GEMV's rows, and one float32-output matmul
def test_float_logits_are_the_heads_logits_in_float32(device, rows):
    torch.manual_seed(0)
    head = ParallelLMHead(300, 64).to(device=device, dtype=torch.bfloat16)
    head.weight.data.normal_(std=0.05)
    hidden = torch.randn(rows, 64, device=device, dtype=torch.bfloat16)
    ref = F.linear(hidden.float(), head.weight.float())
    got = head.float_logits(hidden)
    assert got.dtype == torch.float32 and got.shape == (rows, 300)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # (16-bit logits rounded, or float32 ones)
    out = torch.full((rows + 2, 300), float("nan"), device=device)
    assert head.float_logits(hidden, out=out[:rows]).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out[:rows], got, rtol=0, atol=0)
    assert out[rows:].isnan().all()


def test_a_checkpoint_tensor_stored_fused_loads_into_every_part():
    torch.manual_seed(0)
    col = ColumnParallelLinear(16, [8, 4, 4], bias=True)
    w, b = torch.randn(16, 16), torch.randn(16)
    col.weight_loader(col.weight, w)  # shard None: the whole [q | k | v], as Phi-3's checkpoints hold it
    col.weight_loader(col.bias, b)
    assert torch.equal(col.weight, w) and torch.equal(col.bias, b)
    with pytest.raises(ValueError, match=r"has shape \(15, 16\), expected \(16, 16\)"):
        col.weight_loader(col.weight, torch.zeros(15, 16))


def test_the_down_projection_takes_swiglu_as_its_prologue():
    torch.manual_seed(0)
    down = RowParallelLinear(8, 4, bias=True, swiglu=True)
    w, b = torch.randn(4, 8), torch.randn(4)
    down.weight_loader(down.weight, w)
    down.weight_loader(down.bias, b)
    gate_up = torch.randn(3, 16)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(down(gate_up), F.linear(F.silu(gate) * up, w, b))


def test_a_checkpoint_tensor_of_the_wrong_shape_is_named_in_the_error():
    col = ColumnParallelLinear(16, [8, 4], bias=False)
    with pytest.raises(ValueError, match=r"has shape \(4, 15\), expected \(4, 16\)"):
        col.weight_loader(col.weight, torch.zeros(4, 15), 1)


def test_a_size_that_does_not_divide_by_the_world_size_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(parallel_state, "_world_size", 3)
    with pytest.raises(ValueError, match=r"output size \(8\) is not divisible by the tensor-parallel size \(3\)"):
        ColumnParallelLinear(16, [8], bias=False)


def _layers(rank: int, world_size: int, init_method: str) -> None:
    init_distributed(rank, world_size, init_method, "gloo")
    try:
        torch.manual_seed(0)  # the same full tensors on every rank
        x = torch.randn(5, 16)
        # the attention pattern: fused q/k/v with bias, column-parallel; o with bias, row-parallel
        wq, wk, wv, wo = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4, 16), torch.randn(16, 8)
        bq, bk, bv, bo = torch.randn(8), torch.randn(4), torch.randn(4), torch.randn(16)
        qkv = ColumnParallelLinear(16, [8, 4, 4], bias=True)
        for shard, (w, b) in enumerate([(wq, bq), (wk, bk), (wv, bv)]):
            qkv.weight_loader(qkv.weight, w, shard)
            qkv.weight_loader(qkv.bias, b, shard)
        q, k, v = qkv(x).split([4, 2, 2], dim=-1)
        for mine, full in ((q, F.linear(x, wq, bq)), (k, F.linear(x, wk, bk)), (v, F.linear(x, wv, bv))):
            torch.testing.assert_close(mine, full.chunk(world_size, dim=-1)[rank])
        fused = ColumnParallelLinear(16, [8, 4, 4], bias=True)  # the same matrices stored fused (Phi-3)
        fused.weight_loader(fused.weight, torch.cat([wq, wk, wv]))
        fused.weight_loader(fused.bias, torch.cat([bq, bk, bv]))
        assert torch.equal(fused.weight, qkv.weight) and torch.equal(fused.bias, qkv.bias)
        # the gate/up pattern: the down projection takes this rank's [gate | up] and applies SwiGLU first
        wg, wu, wd = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
        gate_up = ColumnParallelLinear(16, [8, 8], bias=False)
        gate_up.weight_loader(gate_up.weight, wg, 0)
        gate_up.weight_loader(gate_up.weight, wu, 1)
        down = RowParallelLinear(8, 16, bias=False, swiglu=True)
        down.weight_loader(down.weight, wd)
        want = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        torch.testing.assert_close(down(gate_up(x)), want)
        o = RowParallelLinear(8, 16, bias=True)
        o.weight_loader(o.weight, wo)
        o.weight_loader(o.bias, bo)
        torch.testing.assert_close(o(q), F.linear(F.linear(x, wq, bq), wo, bo))
        # a vocabulary of 7 over two ranks: 4 rows each, the last one padding
        table = torch.randn(7, 16)
        emb, head = VocabParallelEmbedding(7, 16), ParallelLMHead(7, 16)
        emb.weight_loader(emb.weight, table)
        head.weight = emb.weight  # tied
        assert emb.weight.shape == (4, 16)
        ids = torch.tensor([0, 3, 4, 6, 2, 6])
        torch.testing.assert_close(emb(ids), F.embedding(ids, table))
        torch.testing.assert_close(head(x), F.linear(x, table))
    finally:
        destroy_distributed()


def test_at_two_ranks_each_layer_computes_the_full_layer_from_the_full_checkpoint_tensors(spawn_ranks):
    spawn_ranks(_layers)
