"""Does the KV cache's layout cap decode attention's bandwidth? (GPU; `python benchmarks/kv_layout_probe.py`)

Decode attention reads each sequence's K/V blocks once per KV head. In the NHD layout ([num_blocks, block_size,
Hkv, D], ours and FlashInfer's default) a (sequence, KV head) program reads 256-byte rows 2 KiB apart; in HND
([num_blocks, Hkv, block_size, D]) the same bytes are one 4 KiB run per block. This times (1) a Triton kernel
that only reads the K and V bytes a decode step reads, in both layouts, against a contiguous copy, and (2)
FlashInfer's decode (tensor cores, graph-mode wrapper) in both layouts on the same data, if installed.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from heron.bench.kernel_timing import paged_batch, time_graph  # noqa: E402
from heron.bench.kernels_flashinfer import fi_pages  # noqa: E402


@triton.jit
def _read_kv(
    cache_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    max_blocks,
    stride_kv,
    stride_blk,
    stride_tok,
    stride_head,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
):
    """Sums the K and V rows of (sequence, KV head), TILE_BLOCKS cache blocks per iteration (as the decode
    kernel's key tiles)."""
    seq, head = tl.program_id(0), tl.program_id(1)
    n_blocks = tl.cdiv(tl.load(lens_ptr + seq), BLOCK)
    tok = tl.arange(0, TILE_BLOCKS * BLOCK)
    d = tl.arange(0, D)
    acc = tl.zeros([TILE_BLOCKS * BLOCK, D], tl.float32)
    for b0 in tl.range(0, n_blocks, TILE_BLOCKS, num_stages=3):
        idx = b0 + tok // BLOCK
        blk = tl.load(tables_ptr + seq * max_blocks + idx, mask=idx < n_blocks, other=0).to(tl.int64)
        offs = blk[:, None] * stride_blk + head * stride_head + (tok % BLOCK)[:, None] * stride_tok + d[None, :]
        ok = (idx < n_blocks)[:, None]
        acc += tl.load(cache_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(cache_ptr + stride_kv + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + seq * tl.num_programs(1) + head, tl.sum(acc))


def probe(batch: int, lo: int, hi: int, hkv: int = 8, hq: int = 32, d: int = 128, block: int = 16) -> None:
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    lens_list = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    nhd, tables, lens = paged_batch(lens_list, block, hkv, d, dev, gen)  # [2, blocks, block, Hkv, D]
    hnd = nhd.transpose(2, 3).contiguous()  # [2, blocks, Hkv, block, D]
    kv_bytes = 2 * sum(lens_list) * hkv * d * 2
    out = torch.empty(batch, hkv, device=dev)
    print(f"B {batch}, contexts U[{lo}, {hi}], {hkv} KV heads, D {d}, block {block}: {kv_bytes / 1e9:.2f} GB of K/V")
    src = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device=dev)
    t = time_graph(lambda: src.clone(), iters=20)
    print(f"  contiguous copy of the same bytes (read + write): {t * 1e6:7.1f} us, {2 * kv_bytes / t / 1e12:.2f} TB/s")
    for name, cache in (("NHD", nhd), ("HND", hnd)):
        s = cache.stride()
        tok, head = (s[2], s[3]) if name == "NHD" else (s[3], s[2])
        for tile in (2, 4, 8):

            def call(cache=cache, tok=tok, head=head, tile=tile):
                _read_kv[(batch, hkv)](
                    cache,
                    tables,
                    lens,
                    out,
                    tables.shape[1],
                    s[0],
                    s[1],
                    tok,
                    head,
                    BLOCK=block,
                    D=d,
                    TILE_BLOCKS=tile,
                    num_warps=4,
                )

            t = time_graph(call, iters=20)
            print(
                f"  read-only kernel, {name}, {tile * block} tokens a tile: {t * 1e6:7.1f} us, "
                f"{kv_bytes / t / 1e12:.2f} TB/s"
            )
    try:
        import flashinfer as fi
    except ImportError:
        print("  (FlashInfer not installed: its decode not timed)")
        return
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    indptr, indices, last = fi_pages(lens_list, tables, block)
    outs = {}
    for layout, cache in (("NHD", nhd), ("HND", hnd)):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(  # as the backend runs it: a graph-mode wrapper
            workspace,
            layout,
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.empty_like(indices),
            paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=dev),
        )
        w.plan(indptr, indices, last, hq, hkv, d, block, q_data_type=q.dtype, kv_data_type=cache.dtype)
        o = outs[layout] = torch.empty_like(q)
        t = time_graph(lambda w=w, cache=cache, o=o: w.run(q, (cache[0], cache[1]), out=o), iters=20)
        print(f"  FlashInfer decode (tensor cores), {layout}: {t * 1e6:7.1f} us, {kv_bytes / t / 1e12:.2f} TB/s")
    print(f"  FlashInfer NHD vs HND max |diff|: {(outs['NHD'] - outs['HND']).abs().max().item():.3g}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    probe(64, 1024, 2048)  # the `kernels` benchmark's decode case
    probe(200, 500, 1200)  # an offline Qwen3-8B decode step (batch ~200, contexts ~800)
    probe(100, 800, 1600)
