"""The "flashinfer" backend: its host-side page tables (on any machine), and on CUDA with flashinfer-python
installed, its outputs against the "torch" backend for decode, prefill over a cached prefix and mixed batches,
and a padded decode batch replayed in a CUDA graph."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from heron.attention.flashinfer_backend import SCRATCH_BLOCK, page_table
from heron.attention.torch_ref import TorchAttentionBackend
from heron.kernels.reference import write_kv_ref
from tests.kernels.kernel_utils import assert_close, make_batch, make_cache

needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs CUDA and flashinfer-python",
)
CUDA = torch.device("cuda")
GQA = [(8, 8), (16, 4), (32, 4)]  # (num_heads, num_kv_heads): group sizes 1, 4, 8


def _page_table(tables: np.ndarray, lens: list[int], block_size: int):
    b = len(lens)
    indptr = np.full(b + 1, -7, np.int32)
    last = np.full(b, -7, np.int32)
    indices = np.full(tables.size + b + 3, -7, np.int32)  # + b: a padded row's scratch page; + 3: a canary
    n = page_table(tables, np.asarray(lens, np.int32), block_size, indptr, indices, last)
    assert (indices[n:] == -7).all(), "wrote past the returned count"
    return indptr, indices[:n], last


def test_a_layer_it_cannot_run_is_refused_by_name():
    """One FlashInfer plan serves every layer: a window, a soft cap or another scale is a clear error (checked
    before anything is planned, so without FlashInfer installed too), the backend's own params pass."""
    from heron.attention.backend import AttentionParams
    from heron.attention.flashinfer_backend import FlashInferAttentionBackend

    fi = object.__new__(FlashInferAttentionBackend)  # no flashinfer import: the check comes first
    fi.scale, fi.default_params = 0.125, AttentionParams(0.125)
    for params in (AttentionParams(0.125, sliding_window=4096), AttentionParams(0.125, logits_soft_cap=50.0)):
        with pytest.raises(ValueError, match="use attention_backend 'triton'"):
            fi.forward(None, None, None, params)
    with pytest.raises(AttributeError):  # past the check: on to planning, which this stub cannot do
        fi.forward(None, None, None, AttentionParams(0.125))


@pytest.mark.parametrize("block_size", [16, 32])
def test_page_table_matches_the_block_tables(block_size):
    rng = np.random.default_rng(block_size)
    lens = [1, 16, 17, 0, 100, 32, 0, 255, 33]
    width = 17  # 255 tokens need 16 blocks of 16; the rest of a row is junk
    tables = rng.integers(1, 1000, (len(lens), width), dtype=np.int32)
    indptr, indices, last = _page_table(tables, lens, block_size)
    assert indptr[0] == 0 and (np.diff(indptr) >= 1).all() and indptr[-1] == len(indices)
    assert ((1 <= last) & (last <= block_size)).all()
    for i, n in enumerate(lens):
        pages = indices[indptr[i] : indptr[i + 1]]
        if n == 0:  # a padded row: one scratch page holding one token
            assert list(pages) == [SCRATCH_BLOCK] and last[i] == 1
            continue
        # FlashInfer's length: full pages, then last_page_len tokens
        assert (len(pages) - 1) * block_size + last[i] == n
        # token p of the sequence lives where the block table says
        slots = [int(pages[p // block_size]) * block_size + p % block_size for p in range(n)]
        assert slots == [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)]


def test_page_table_of_all_padded_and_empty_batches():
    indptr, indices, last = _page_table(np.zeros((4, 3), np.int32), [0, 0, 0, 0], 16)
    assert list(indptr) == [0, 1, 2, 3, 4] and list(indices) == [SCRATCH_BLOCK] * 4 and list(last) == [1] * 4
    indptr, indices, _ = _page_table(np.zeros((0, 3), np.int32), [], 16)
    assert indptr[0] == 0 and len(indices) == 0


# -- CUDA with flashinfer ----------------------------------------------------------------------------------


def _backend(num_heads, num_kv_heads, head_dim, max_seqs, meta, block_size=16):
    from heron.attention.flashinfer_backend import FlashInferAttentionBackend

    fi = FlashInferAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    fi.reserve(
        max_seqs, CUDA, dtype=torch.bfloat16, block_size=block_size, max_blocks_per_seq=meta.block_tables.shape[1]
    )
    return fi


def _inputs(t, num_heads, num_kv_heads, head_dim, gen):
    shapes = [(t, num_heads, head_dim), (t, num_kv_heads, head_dim), (t, num_kv_heads, head_dim)]
    return [torch.randn(s, generator=gen).to(CUDA, torch.bfloat16) for s in shapes]


def _reference(q, cache, meta):
    """The torch backend in float32 on the cache (this step's K/V already written, as the model writes them)."""
    return TorchAttentionBackend(q.shape[1], cache.shape[3], q.shape[2], q.shape[2] ** -0.5).forward(
        q.float(), cache.float(), meta
    )


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_matches_torch_backend(kind, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(len(kind) * 1000 + num_heads * 10 + head_dim)
    # prefill: a whole prompt, and two chunks over a cached prefix (their queries sit at the end of their keys)
    seq_lens = {"decode": [37, 129, 1, 16, 700], "prefill": [300, 64, 17], "mixed": [25, 7, 400, 1, 16]}[kind]
    q_lens = {"decode": [1] * 5, "prefill": [300, 20, 5], "mixed": [1, 7, 100, 1, 16]}[kind]
    meta = make_batch(seq_lens, q_lens, 16, CUDA, gen)
    cache = make_cache(meta.num_blocks, 16, num_kv_heads, head_dim, torch.bfloat16, CUDA, gen)
    q, k, v = _inputs(meta.num_tokens, num_heads, num_kv_heads, head_dim, gen)
    write_kv_ref(k, v, cache, meta.slot_mapping)
    want = _reference(q, cache, meta)
    fi = _backend(num_heads, num_kv_heads, head_dim, len(seq_lens), meta)
    fi.prepare(meta)
    got = fi.forward(q, cache, meta)
    assert_close(got, want, torch.bfloat16, f"{kind} GQA {num_heads // num_kv_heads} D {head_dim}")


def _padded(meta, padded: int, gen):
    """`meta`'s decode batch padded to `padded` rows as the runner pads a graph batch: seq_len 0, slot -1,
    query_start_loc counting on; the padded rows' block tables hold junk that must never be read."""
    extra = padded - meta.num_seqs
    dev = lambda x: x.to(meta.seq_lens.device)  # noqa: E731
    tables = torch.cat(
        [
            meta.block_tables_cpu,
            torch.randint(0, 10**6, (extra, meta.block_tables.shape[1]), generator=gen, dtype=torch.int32),
        ]
    )
    lens = torch.cat([meta.seq_lens_cpu, torch.zeros(extra, dtype=torch.int32)])
    qsl = torch.arange(padded + 1, dtype=torch.int32)
    slots = torch.cat([meta.slot_mapping.cpu(), torch.full((extra,), -1, dtype=torch.int64)])
    return dataclasses.replace(
        meta,
        num_seqs=padded,
        num_tokens=padded,
        query_start_loc=dev(qsl),
        seq_lens=dev(lens),
        block_tables=dev(tables),
        slot_mapping=dev(slots),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        block_tables_cpu=tables,
        cuda_graph=True,
    )


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (32, 4)])  # CUDA-core and tensor-core decode
def test_padded_decode_replays_in_a_cuda_graph(num_heads, num_kv_heads):
    """Capture the decode of a batch padded to 8 rows once; then for new lengths, tables and inputs (5 and
    then 7 real rows, their K/V written first) re-plan with prepare() and replay: the real rows must follow
    the new values."""
    gen = torch.Generator().manual_seed(num_heads)
    head_dim, padded, block_size, width = 128, 8, 16, 72  # width: blocks per table row
    num_blocks = padded * width + 8

    def batch(lens):
        meta = make_batch(
            lens,
            [1] * len(lens),
            block_size,
            CUDA,
            gen,
            extra_blocks=num_blocks - sum(-(-n // block_size) for n in lens),
        )
        meta.block_tables_cpu = torch.cat(
            [meta.block_tables_cpu, torch.zeros(len(lens), width - meta.block_tables_cpu.shape[1], dtype=torch.int32)],
            1,
        )
        meta.block_tables = meta.block_tables_cpu.to(CUDA)
        return meta

    first = batch([300, 5, 17, 640, 1])
    graph_meta = _padded(first, padded, gen)
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.bfloat16, CUDA, gen)
    q, k, v = _inputs(padded, num_heads, num_kv_heads, head_dim, gen)
    fi = _backend(num_heads, num_kv_heads, head_dim, padded, graph_meta)
    fi.prepare(graph_meta)
    fi.forward(q, cache, graph_meta)  # eager first: plans and compiles outside the capture
    torch.cuda.synchronize()
    fi.prepare(graph_meta)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.forward(q, cache, graph_meta)

    for lens in ([64, 1000, 3, 16, 33], [2, 640, 17, 129, 48, 1, 600]):
        real = batch(lens)
        step = _padded(real, padded, gen)
        graph_meta.slot_mapping.copy_(step.slot_mapping)  # the one metadata tensor the graph reads
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=gen))
        n = len(lens)
        write_kv_ref(k[:n], v[:n], cache, real.slot_mapping)
        want = _reference(q[:n], cache, real)
        fi.prepare(step)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out[:n], want, torch.bfloat16, f"replay with {n} rows")
