"""The recorded `kernels` benchmark (GPU): our paged decode and prefill kernels against FlashInfer's on the same
inputs, and the PyTorch reference; `python -m heron.bench.kernels --vs-flashinfer [--save-result]` runs it and
saves benchmarks/results/kernels.json."""

from __future__ import annotations

import shlex
import sys

import numpy as np
import torch

from heron.bench.kernel_timing import paged_batch, time_eager, time_graph


def _reference_meta(seq_lens: list[int], q_len: int, tables: torch.Tensor):
    """AttentionMetadata of B sequences with q_len new tokens each, for the PyTorch reference."""
    from heron.attention.backend import AttentionMetadata

    b, dev = len(seq_lens), tables.device
    qsl = torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_seqs=b,
        num_tokens=b * q_len,
        query_start_loc=qsl.to(dev),
        seq_lens=lens.to(dev),
        block_tables=tables,
        slot_mapping=torch.empty(0, dtype=torch.int64, device=dev),
        max_query_len=q_len,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        block_tables_cpu=tables.cpu(),
    )


def fi_pages(seq_lens: list[int], tables: torch.Tensor, block_size: int):
    """FlashInfer's page table of a batch, as the backend builds it: host indptr and last_page_len, device
    indices."""
    from heron.attention.flashinfer_backend import page_table

    b = len(seq_lens)
    indptr, last, indices = np.zeros(b + 1, np.int32), np.zeros(b, np.int32), np.zeros(tables.numel(), np.int32)
    n = page_table(tables.cpu().numpy(), np.asarray(seq_lens), block_size, indptr, indices, last)
    return torch.from_numpy(indptr), torch.from_numpy(indices[:n]).to(tables.device), torch.from_numpy(last)


def _fi_decode(fi, workspace, q, cache, pages, scale, tensor_cores: bool):
    """A call of FlashInfer's decode as the backend makes it in a CUDA graph (use_cuda_graph=True, fixed
    buffers), planned once; returns (call, its output)."""
    indptr, indices, last = pages
    b, dev = len(last), q.device
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.empty_like(indices),
        paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev),
    )
    wrapper.plan(
        indptr,
        indices,
        last,
        q.shape[1],
        cache.shape[3],
        q.shape[2],
        cache.shape[2],
        q_data_type=q.dtype,
        kv_data_type=cache.dtype,
        sm_scale=scale,
    )
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (cache[0], cache[1]), out=out), out


def _fi_prefill(fi, workspace, q, cache, pages, qsl_cpu, scale):
    """A call of FlashInfer's causal paged prefill, planned once; returns (call, its output)."""
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        qsl_cpu,
        *pages,
        q.shape[1],
        cache.shape[3],
        q.shape[2],
        cache.shape[2],
        causal=True,
        q_data_type=q.dtype,
        kv_data_type=cache.dtype,
        sm_scale=scale,
    )
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (cache[0], cache[1]), out=out), out


def _agree(what: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """Print the max abs difference and assert it is within bf16 tolerance (the kernel tests' bound: 4e-2
    + 2e-2 * max |want|)."""
    diff = (got.float() - want.float()).abs().max().item()
    bound = 4e-2 + 2e-2 * want.float().abs().max().item()
    print(f"  max |{what}| = {diff:.3g} (bound {bound:.3g})")
    assert diff < bound, f"{what}: outputs disagree beyond bf16 tolerance ({diff:.3g} >= {bound:.3g})"
    return diff


def _measure(what: str, fn):
    """fn(), or None with the reason printed: one FlashInfer variant that fails to build must not cost the
    rest of a device run. Outputs that disagree (AssertionError) still stop the benchmark."""
    try:
        return fn()
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001
        print(f"  {what}: failed ({type(e).__name__}: {str(e)[:300]})")
        return None


def bench_vs_flashinfer(
    save: bool = False,
    batch: int = 64,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    min_len: int = 1024,
    max_len: int = 2048,
    new_tokens: int = 256,
    seed: int = 0,
) -> dict:
    """Issue 4's `kernels` benchmark, on one set of inputs per case. Decode: B sequences with contexts uniform
    in [min_len, max_len], one query each: our split-KV kernel, FlashInfer's decode (CUDA-core and
    tensor-core kinds, as our backend runs them in a CUDA graph; the faster one is "FlashInfer") and the
    PyTorch reference. Prefill: new_tokens more tokens per sequence over such a context (a chunk over a cached
    prefix): our paged prefill against FlashInfer's causal paged prefill. Our kernels and FlashInfer's are timed
    by CUDA-graph replay, the reference eagerly. Ratios are our time / FlashInfer's (target <= 1.2); outputs
    must agree within bf16 tolerance. Without flashinfer-python, ours and the reference are still timed and
    nothing is saved."""
    from heron.attention.torch_ref import paged_attention_batched
    from heron.bench.report import format_table, make_result, save_result
    from heron.kernels.paged_decode import paged_decode_attention
    from heron.kernels.paged_prefill import paged_prefill_attention

    if not torch.cuda.is_available():
        raise SystemExit("the kernels benchmark needs a CUDA device")
    try:
        import flashinfer as fi
    except ImportError as e:
        fi = None
        print(
            f"FlashInfer is not importable ({e}): timing ours and the PyTorch reference only, saving nothing. "
            "Install flashinfer-python==0.6.18.post1 (pip install 'heron[flashinfer]')."
        )
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    scale = head_dim**-0.5
    ctx = torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()
    m: dict = {
        "shape": f"B {batch}, {num_heads}/{num_kv_heads} heads, D {head_dim}, block {block_size}, bf16, "
        f"context U[{min_len}, {max_len}] (mean {sum(ctx) / batch:.0f}), prefill +{new_tokens}",
        "flashinfer_version": fi.__version__ if fi else None,
    }
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev) if fi else None
    if fi:
        print(
            "FlashInfer JIT-compiles each kernel on first use (minutes without a carried cache: "
            "benchmarks/flashinfer_cache.sh)"
        )

    print(f"decode: {m['shape']}")
    cache, tables, lens = paged_batch(ctx, block_size, num_kv_heads, head_dim, dev, gen)
    q = torch.randn(batch, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    ours = torch.empty_like(q)
    t_ours = time_graph(lambda: paged_decode_attention(q, cache, tables, lens, scale, out=ours))
    meta = _reference_meta(ctx, 1, tables)
    ref = paged_attention_batched(q, cache, meta, scale)
    t_ref = time_eager(lambda: paged_attention_batched(q, cache, meta, scale))
    _agree("heron - torch ref", ours, ref)
    kv_bytes = sum(ctx) * num_kv_heads * head_dim * 2 * cache.element_size()
    m.update(decode_us_heron=t_ours * 1e6, decode_us_torch_ref=t_ref * 1e6, decode_kv_TBps=kv_bytes / t_ours / 1e12)
    fi_times = {}
    if fi:
        pages = fi_pages(ctx, tables, block_size)
        for kind, tensor_cores in (("cuda_cores", False), ("tensor_cores", True)):

            def run(tensor_cores=tensor_cores):
                fn, out = _fi_decode(fi, workspace, q, cache, pages, scale, tensor_cores)
                t = time_graph(fn)
                _agree(f"flashinfer {kind} - heron", out, ours)
                _agree(f"flashinfer {kind} - torch ref", out, ref)
                m[f"decode_max_abs_diff_vs_flashinfer_{kind}"] = (out.float() - ours.float()).abs().max().item()
                return t

            fi_times[kind] = _measure(f"flashinfer decode ({kind})", run)
            m[f"decode_us_flashinfer_{kind}"] = fi_times[kind] * 1e6 if fi_times[kind] else None
    t_fi = min((t for t in fi_times.values() if t), default=None)
    m["decode_us_flashinfer"] = t_fi * 1e6 if t_fi else None
    m["decode_ratio_vs_flashinfer"] = t_ours / t_fi if t_fi else None

    print(f"prefill: {new_tokens} new tokens per sequence over those contexts")
    seq_lens = [n + new_tokens for n in ctx]
    cache, tables, lens = paged_batch(seq_lens, block_size, num_kv_heads, head_dim, dev, gen)
    q = torch.randn(batch * new_tokens, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    meta = _reference_meta(seq_lens, new_tokens, tables)
    ours = torch.empty_like(q)
    t_ours = time_graph(
        lambda: paged_prefill_attention(q, cache, tables, lens, meta.query_start_loc, new_tokens, scale, out=ours),
        iters=10,
    )
    ref = paged_attention_batched(q, cache, meta, scale)
    _agree("heron - torch ref", ours, ref)
    keys = sum(new_tokens * n + new_tokens * (new_tokens + 1) // 2 for n in ctx)  # causal: query t sees n + t + 1
    flops = 4 * num_heads * head_dim * keys
    m.update(prefill_us_heron=t_ours * 1e6, prefill_TFLOPs_heron=flops / t_ours / 1e12)
    t_fi = None
    if fi:

        def run():
            fn, out = _fi_prefill(
                fi, workspace, q, cache, fi_pages(seq_lens, tables, block_size), meta.query_start_loc_cpu, scale
            )
            t = time_graph(fn, iters=10)
            _agree("flashinfer - heron", out, ours)
            _agree("flashinfer - torch ref", out, ref)
            m["prefill_max_abs_diff_vs_flashinfer"] = (out.float() - ours.float()).abs().max().item()
            return t

        t_fi = _measure("flashinfer prefill", run)
    m.update(
        prefill_us_flashinfer=t_fi * 1e6 if t_fi else None,
        prefill_TFLOPs_flashinfer=flops / t_fi / 1e12 if t_fi else None,
        prefill_ratio_vs_flashinfer=t_ours / t_fi if t_fi else None,
    )

    rows = [
        (
            "decode",
            m["decode_us_heron"],
            m["decode_us_flashinfer"],
            m["decode_ratio_vs_flashinfer"],
            m["decode_us_torch_ref"],
            f"{m['decode_kv_TBps']:.2f} TB/s K/V",
        ),
        (
            "prefill",
            m["prefill_us_heron"],
            m["prefill_us_flashinfer"],
            m["prefill_ratio_vs_flashinfer"],
            None,
            f"{m['prefill_TFLOPs_heron']:.0f} TFLOP/s",
        ),
    ]
    print(
        format_table(
            rows, ("case", "heron us", "flashinfer us", "ratio (target <= 1.2)", "torch ref us", "heron achieved")
        )
    )
    print("flashinfer decode kinds (us):", {k: m.get(f"decode_us_flashinfer_{k}") for k in fi_times})
    result = make_result("kernels", m, dev, command=shlex.join(["python", "-m", "heron.bench.kernels", *sys.argv[1:]]))
    if save and fi:
        print(f"saved {save_result(result)}")
    return result
