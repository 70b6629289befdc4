"""Micro-benchmark of the attention kernels on a GPU: `python -m heron.kernels.bench [--sweep]`.

Decode: B sequences of uniform random length in [min_len, max_len], H query / Hkv KV heads, head_dim D,
block size 16, bf16, shuffled block tables. Reports the time per call (CUDA-graph replay, so launch overhead
is excluded as in the engine's decode step) and the achieved bandwidth over the K/V bytes read. Prefill:
whole prompts and chunks over cached prefixes, reports TFLOP/s of the causal attention (`--prefill-only`:
just that, e.g. with --sweep).

`python -m heron.kernels.bench --vs-flashinfer [--save-result]`: the recorded `kernels` benchmark, ours
against FlashInfer's kernels on the same inputs (`bench_vs_flashinfer`), saved as benchmarks/results/kernels.json.

`python -m heron.kernels.bench --gemv [--sweep] [--only qwen|llama] [--rows 1,8,16,...]`: the decode weight GEMMs,
heron.kernels.gemv against cuBLAS (and cuBLASLt past 16 rows) (`bench_gemv`); --sweep searches gemv's configs per
shape. `--decode-only [--sweep]`: the decode kernel on the `kernels` case and two offline Qwen3-8B decode steps.

`python -m heron.kernels.bench --sampling [--sweep] [--rows 1,64,...]`: heron.kernels.sampling.sample_tokens on
Qwen3's vocabulary (`bench_sampling`), checked bit for bit against the PyTorch reference; --sweep also times
other warps / splits.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import time

import numpy as np
import torch


def _batch(seq_lens, block_size, num_kv_heads, head_dim, device, gen):
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    return cache, tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _time_graph(fn, iters: int = 50) -> float:
    """Mean seconds per call, replaying a CUDA graph of `iters` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * iters)


def _decode_call(batch: int, lens: tuple[int, int], seed: int, shape: tuple[int, int, int, int]):
    """call(cfg) = the paged decode kernel with config cfg on B sequences of uniform random lengths in `lens`
    (shape: heads, KV heads, head dim, block size); cfg's `longest_first=True` passes the engine's launch order
    (a flag, not the order itself, so that configs stay picklable for _compile_ahead's workers). Also returns
    the K/V bytes it reads and the lengths."""
    from heron.kernels.paged_decode import longest_first, paged_decode_attention

    num_heads, num_kv_heads, head_dim, block_size = shape
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(lens[0], lens[1] + 1, (batch,), generator=gen).tolist()
    cache, tables, lens_t = _batch(seq_lens, block_size, num_kv_heads, head_dim, dev, gen)
    q = torch.randn(batch, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * cache.element_size()
    order = longest_first(lens_t)

    def call(cfg: dict) -> torch.Tensor:
        cfg = dict(cfg)
        ordered = cfg.pop("longest_first", False)
        return paged_decode_attention(
            q, cache, tables, lens_t, head_dim**-0.5, out=out, order=order if ordered else None, **cfg
        )

    return call, kv_bytes, seq_lens


def _decode_kernel_call(build):
    return build()[0]


def _decode_configs(default_p: int) -> list[dict]:
    """The decode sweep: P / 2, P and 2P partitions, tiles of 32-128 keys, 4/8 warps, 2/3 stages; launched as the
    triton backend launches them (longest first, KV heads innermost, at <= 2 partitions)."""
    parts = sorted({max(1, default_p // 2), default_p, 2 * default_p})
    return [
        dict(
            num_partitions=p,
            block_n=bn,
            num_warps=w,
            num_stages=s,
            **(dict(longest_first=True, heads_first=True) if p <= 2 else {}),
        )
        for p, bn, w, s in itertools.product(parts, (32, 64, 128), (4, 8), (2, 3))
    ]


def bench_decode(
    batch=64, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, min_len=1024, max_len=2048, sweep=False, seed=0
):
    import functools

    from heron.kernels.paged_decode import default_num_partitions

    shape = (num_heads, num_kv_heads, head_dim, block_size)
    build = functools.partial(_decode_call, batch, (min_len, max_len), seed, shape)
    call, kv_bytes, seq_lens = build()
    default_p = default_num_partitions(batch, num_kv_heads, torch.device("cuda"))
    print(
        f"decode B={batch} H={num_heads} Hkv={num_kv_heads} D={head_dim} bs={block_size} "
        f"len {min_len}-{max_len} (mean {sum(seq_lens) / batch:.0f}): K/V {kv_bytes / 1e6:.1f} MB, "
        f"at 4.0 TB/s {kv_bytes / 4.0e12 * 1e6:.1f} us; default P={default_p}"
    )
    configs = [
        dict(num_partitions=None, longest_first=lf, heads_first=hf) for hf in (False, True) for lf in (False, True)
    ]
    if sweep:
        configs += _decode_configs(default_p)
        _compile_ahead(functools.partial(_decode_kernel_call, build), configs)
    _time_configs(configs, call, lambda t: f"{kv_bytes / t / 1e12:5.2f} TB/s", iters=50, best=sweep)


def _time_configs(configs: list[dict], call, rate, iters: int, best: bool) -> None:
    """Time call(cfg) per config by graph replay and print each with rate(seconds); configs that do not
    compile (shared memory) are reported and skipped; `best`: print the five fastest."""
    results = []
    for cfg in configs:
        try:
            t = _time_graph(lambda cfg=cfg: call(cfg), iters=iters)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
            continue
        results.append((t, cfg))
        print(f"  {cfg}: {t * 1e6:8.1f} us  {rate(t)}")
    if best and results:
        results.sort(key=lambda r: r[0])
        print("  best:", [f"{t * 1e6:.1f} us {c}" for t, c in results[:5]])


def _prefill_call(prefix: list[int], q_len: int, seed: int, shape: tuple[int, int, int, int]):
    """call(cfg) = the paged prefill kernel with config cfg on q_len new tokens per sequence over cached prefixes
    of the given lengths (shape: heads, KV heads, head dim, block size); the sweep's builder."""
    from heron.kernels.paged_prefill import paged_prefill_attention

    num_heads, num_kv_heads, head_dim, block_size = shape
    dev, gen, b = torch.device("cuda"), torch.Generator().manual_seed(seed), len(prefix)
    cache, tables, lens = _batch([n + q_len for n in prefix], block_size, num_kv_heads, head_dim, dev, gen)
    qsl = torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=dev)
    q = torch.randn(b * q_len, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    out, scale = torch.empty_like(q), head_dim**-0.5
    return lambda cfg: paged_prefill_attention(q, cache, tables, lens, qsl, q_len, scale, out=out, **cfg)


def bench_prefill(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, sweep=False, seed=1):
    """The paged prefill kernel on two shapes: 4 whole 2048-token prompts (the prefill benchmark's steps) and
    256 new tokens per sequence over 64 cached contexts of 1024-2048 tokens (the `kernels` benchmark's case).
    Reports TFLOP/s of the causal attention; with `sweep` (the second shape only), every tile/warps/stages config
    (8 warps held to 128 registers: two programs per SM) and the five best."""
    import functools

    import torch.nn.functional as F

    dev, shape = torch.device("cuda"), (num_heads, num_kv_heads, head_dim, block_size)
    ctx = torch.randint(1024, 2049, (64,), generator=torch.Generator().manual_seed(seed)).tolist()
    cases = [("4 x 2048-token prompts", [0] * 4, 2048), ("64 x 256 new tokens over 1024-2048 cached", ctx, 256)]
    for label, prefix, q_len in cases[1:] if sweep else cases:
        b = len(prefix)
        keys = sum(q_len * n + q_len * (q_len + 1) // 2 for n in prefix)  # causal: query t sees n + t + 1 keys
        flops = 4 * num_heads * head_dim * keys
        print(f"prefill {label}: H={num_heads} Hkv={num_kv_heads} D={head_dim}")
        build = functools.partial(_prefill_call, prefix, q_len, seed, shape)
        configs = [dict()]
        if sweep:
            configs += [
                dict(block_m=m, block_n=n, num_warps=w, num_stages=s, maxnreg=128 if w == 8 else 255)
                for m, n, w, s in itertools.product([64, 128, 256], [16, 32, 64], [4, 8], [3, 4])
            ]
            _compile_ahead(build, configs)
        _time_configs(configs, build(), lambda t: f"{flops / t / 1e12:6.1f} TFLOP/s", iters=10, best=sweep)
        if not any(prefix):
            qs = torch.randn(b, num_heads, q_len, head_dim, device=dev, dtype=torch.bfloat16)
            ks = torch.randn(b, num_kv_heads, q_len, head_dim, device=dev, dtype=torch.bfloat16)
            t = _time_graph(
                lambda: F.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True), iters=10
            )
            print(f"  torch SDPA (contiguous K/V, for scale): {t * 1e6:8.1f} us  {flops / t / 1e12:6.1f} TFLOP/s")


def _time_eager(fn, iters: int = 5) -> float:
    """Mean seconds per call of a function that cannot be captured (the PyTorch reference reads lengths back)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


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


def _fi_pages(seq_lens: list[int], tables: torch.Tensor, block_size: int):
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
    cache, tables, lens = _batch(ctx, block_size, num_kv_heads, head_dim, dev, gen)
    q = torch.randn(batch, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    ours = torch.empty_like(q)
    t_ours = _time_graph(lambda: paged_decode_attention(q, cache, tables, lens, scale, out=ours))
    meta = _reference_meta(ctx, 1, tables)
    ref = paged_attention_batched(q, cache, meta, scale)
    t_ref = _time_eager(lambda: paged_attention_batched(q, cache, meta, scale))
    _agree("heron - torch ref", ours, ref)
    kv_bytes = sum(ctx) * num_kv_heads * head_dim * 2 * cache.element_size()
    m.update(decode_us_heron=t_ours * 1e6, decode_us_torch_ref=t_ref * 1e6, decode_kv_TBps=kv_bytes / t_ours / 1e12)
    fi_times = {}
    if fi:
        pages = _fi_pages(ctx, tables, block_size)
        for kind, tensor_cores in (("cuda_cores", False), ("tensor_cores", True)):

            def run(tensor_cores=tensor_cores):
                fn, out = _fi_decode(fi, workspace, q, cache, pages, scale, tensor_cores)
                t = _time_graph(fn)
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
    cache, tables, lens = _batch(seq_lens, block_size, num_kv_heads, head_dim, dev, gen)
    q = torch.randn(batch * new_tokens, num_heads, head_dim, device=dev, dtype=torch.bfloat16)
    meta = _reference_meta(seq_lens, new_tokens, tables)
    ours = torch.empty_like(q)
    t_ours = _time_graph(
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
                fi, workspace, q, cache, _fi_pages(seq_lens, tables, block_size), meta.query_start_loc_cpu, scale
            )
            t = _time_graph(fn, iters=10)
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
    result = make_result("kernels", m, dev, command=shlex.join(["python", "-m", "heron.kernels.bench", *sys.argv[1:]]))
    if save and fi:
        print(f"saved {save_result(result)}")
    return result


# Decode weight GEMMs: model -> (decoder layers, [(name, N, K)] of one layer, the LM head's (name, N, K)).
GEMV_MODELS = {
    "Qwen3-0.6B": (
        28,
        [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
        ("lm_head", 151936, 1024),
    ),
    "Llama-3.1-8B": (
        32,
        [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
        ("lm_head", 128256, 4096),
    ),
    "Qwen3-8B": (
        36,
        [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
        ("lm_head", 151936, 4096),
    ),
}
GEMV_ROWS = (1, 8, 16, 32, 64, 128, 192, 200, 256)  # > 16: cuBLAS only (the offline run's decode batches)


def _compile_one(build, configs: list) -> None:
    call = build()
    for cfg in configs:
        try:
            call(cfg)
        except Exception:  # noqa: BLE001 - the timing loop reports configs that do not compile
            pass
    torch.cuda.synchronize()


def _compile_ahead(build, configs: list, workers: int = 12) -> None:
    """Compiles every config's kernel in worker processes before a sweep times them one by one: Triton compiles
    one binary at a time (seconds each) and its on-disk cache then serves the timing loop. `build` (picklable,
    e.g. a functools.partial of a module-level function) returns call(cfg) on inputs of the timed shapes, so the
    workers' binaries specialise as the timing loop's will."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    start, workers = time.perf_counter(), max(1, min(workers, len(configs)))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile_one, [build] * workers, [configs[i::workers] for i in range(workers)]))
    print(f"  compiled {len(configs)} configs in {workers} processes: {time.perf_counter() - start:.0f} s")


def _weight_copies(n: int, k: int, dev: torch.device) -> list[torch.Tensor]:
    """Copies of an [N, K] bf16 weight, >= 256 MiB in all: a decode step reads every weight once from HBM, and
    replaying one small matrix would read it from the 50 MB L2 instead."""
    copies = max(1, min(64, -(-(256 << 20) // (2 * n * k))))
    return [torch.randn(n, k, device=dev, dtype=torch.bfloat16).mul_(k**-0.5) for _ in range(copies)]


def _time_rotating(call, weights: list[torch.Tensor]) -> float:
    """Seconds per call(w) in a CUDA graph cycling through the weight copies (>= 512 MiB of weights per replay)."""
    nbytes = weights[0].numel() * weights[0].element_size()
    it = itertools.cycle(weights)
    return _time_graph(lambda: call(next(it)), iters=max(len(weights), 3, -(-(512 << 20) // nbytes)))


def _gemv_candidates(m: int, n: int, k: int, sms: int) -> list:
    """The sweep's grid for one shape: tiles x warps x stages, each with the split counts from the first giving
    >= 1/2 program per SM to the first giving >= 2 (at most 16, at most one split per K-tile). M == 1 adds the
    FMA path; the tensor-core tiles are shared by every M (one binary), so M < 16 reuses M = 16's best."""
    from heron.kernels.gemv import GemvConfig

    def splits(bn: int, bk: int) -> list[int]:
        tiles, k_tiles = -(-n // bn), -(-k // bk)
        ok = [s for s in (1, 2, 4, 8, 16) if s <= k_tiles]
        lo = next((s for s in ok if 2 * tiles * s >= sms), ok[-1])
        hi = next((s for s in ok if tiles * s >= 2 * sms), ok[-1])
        return [s for s in ok if lo <= s <= hi]

    tiles = (
        [(bn, bk, True) for bn in (32, 64, 128) for bk in (128, 256)]
        if m > 1
        else [(bn, bk, False) for bn, bk in ((8, 512), (8, 1024), (16, 256), (16, 512), (32, 256))]
    )
    return [
        GemvConfig(bn, bk, s, w, st, dot)
        for bn, bk, dot in tiles
        if bk <= k
        for w in (4, 8)
        for st in (2, 3, 4)
        if not dot or st * (bn + 16) * bk * 2 <= 200 << 10
        for s in splits(bn, bk)
    ]


def _gemv_sweep(n: int, k: int, xs: dict, weights: list[torch.Tensor], default: dict, best: dict) -> None:
    """Times the candidate configs of one shape at M = 16, then 8 and 1 (M = 16's six best tensor-core configs,
    plus the FMA grid for M = 1); prints the three best per M and records (time, config, default's time) in
    `best[(m, n, k)]`."""
    from heron.kernels.gemv import gemv

    sms = torch.cuda.get_device_properties(weights[0].device).multi_processor_count
    nbytes, top_dot = 2 * n * k, []
    for m in (16, 8, 1):
        x = xs[m]
        cands = (_gemv_candidates(16, n, k, sms) if m == 16 else top_dot[:6]) + (
            _gemv_candidates(1, n, k, sms) if m == 1 else []
        )
        results, failed = [], 0
        for cfg in cands:
            try:
                results.append((_time_rotating(lambda w, cfg=cfg: gemv(x, w, config=cfg), weights), cfg))
            except Exception:  # noqa: BLE001 - a config that does not compile or launch (shared memory) is skipped
                failed += 1
        results.sort(key=lambda r: r[0])
        if m == 16:
            top_dot = [c for _, c in results]
        t_def = default[m]
        print(f"    sweep M={m}: {len(results)} configs ({failed} failed); default {t_def * 1e6:.1f} us")
        for t, cfg in results[:3]:
            print(f"      {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s  x{t_def / t:4.2f} vs default  {cfg}")
        if results:
            best[(m, n, k)] = (*results[0], t_def)


def bench_gemv(sweep: bool = False, only: str | None = None, rows: tuple[int, ...] = GEMV_ROWS) -> None:
    """Decode GEMMs y = x @ W^T (bf16, M rows): heron.kernels.gemv with its default configs against F.linear
    (cuBLAS), both by CUDA-graph replay over rotating weight copies, for the per-layer matrices and the LM head
    of Qwen3-0.6B, Llama-3.1-8B and Qwen3-8B; then per model the sum over one decode step (layers x per-layer + head).
    TB/s counts the weight bytes. `sweep`: also search `_gemv_candidates` per shape and print the best."""
    import torch.nn.functional as F

    from heron.kernels.gemv import MAX_M, gemv, pick_config
    from heron.models.blas import linear_lt

    dev, start, best = torch.device("cuda"), time.perf_counter(), {}
    print(f"gemv: {torch.cuda.get_device_name(dev)}, bf16, CUDA-graph replay, weights rotated past the L2 cache")
    for model, (layers, per_layer, head) in GEMV_MODELS.items():
        if only and only.lower() not in model.lower():
            continue
        step = {m: [0.0, 0.0, 0.0] for m in rows}  # torch s, gemv s, best-of-sweep s per decode step
        lt = dict.fromkeys(rows, 0.0)  # cuBLASLt s per decode step
        step_bytes = 0
        for name, n, k in [*per_layer, head]:
            count = 1 if (name, n, k) == head else layers
            weights, nbytes = _weight_copies(n, k, dev), 2 * n * k
            step_bytes += count * nbytes
            print(f"{model} {name} N={n} K={k} ({nbytes / 1e6:.1f} MB, x{count} per step)")
            xs, default = {}, {}
            for m in rows:
                x = xs[m] = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                t_torch = _time_rotating(lambda w: F.linear(x, w), weights)
                line = (
                    f"  M={m:<3d} torch {t_torch * 1e6:8.1f} us {nbytes / t_torch / 1e12:5.2f} TB/s "
                    f"{2 * m * n * k / t_torch / 1e12:4.0f} TFLOP/s"
                )
                step[m][0] += count * t_torch
                if m > MAX_M:  # cuBLASLt's heuristics pick other kernels than cuBLAS's
                    t_lt = _time_rotating(lambda w: linear_lt(x, w), weights)
                    line += f" | cublasLt {t_lt * 1e6:8.1f} us x{t_torch / t_lt:4.2f}"
                    lt[m] += count * t_lt
                else:
                    cfg = pick_config(m, n, k, x.dtype, dev)
                    t = default[m] = _time_rotating(lambda w: gemv(x, w), weights)
                    ref = F.linear(x.float(), weights[0].float())
                    diff = (gemv(x, weights[0]).float() - ref).abs().max().item()
                    assert diff < 2e-2 * ref.abs().max().item() + 1e-2, f"gemv disagrees with F.linear: {diff:.3g}"
                    line += (
                        f" | gemv {t * 1e6:8.1f} us {nbytes / t / 1e12:5.2f} TB/s x{t_torch / t:4.2f}"
                        f" (max|diff| {diff:.2g}) {cfg}"
                    )
                    step[m][1] += count * t
                print(line)
            if sweep and all(m in xs for m in (1, 8, 16)):
                _gemv_sweep(n, k, xs, weights, default, best)
                for m in default:
                    step[m][2] += count * min(default[m], best.get((m, n, k), (default[m],))[0])
            del weights
        print(f"{model}: the weight GEMMs of one decode step ({step_bytes / 1e9:.2f} GB)")
        for m, (t_torch, t_gemv, t_best) in step.items():
            line = (
                f"  M={m:<3d} torch {t_torch * 1e6:8.1f} us {step_bytes / t_torch / 1e12:5.2f} TB/s "
                f"{m * step_bytes / t_torch / 1e12:6.1f} TFLOP/s"
            )  # 2 FLOPs per 2-byte weight and row
            if lt[m]:
                line += f" | cublasLt {lt[m] * 1e6:8.1f} us"
            if t_gemv:
                line += f" | gemv {t_gemv * 1e6:8.1f} us {step_bytes / t_gemv / 1e12:5.2f} TB/s"
            if t_best:
                line += f" | swept best {t_best * 1e6:8.1f} us {step_bytes / t_best / 1e12:5.2f} TB/s"
            print(line)
    if sweep:
        print("swept configs beating the default by > 3% (for gemv.CONFIGS, or a better default_config):")
        for (m, n, k), (t, cfg, t_def) in sorted(best.items()):
            if t < 0.97 * t_def:
                print(f"  CONFIGS[({m}, {n}, {k})] = {cfg!r}  # {t * 1e6:.1f} us, default {t_def * 1e6:.1f} us")
    print(f"gemv bench: {time.perf_counter() - start:.0f} s")


SAMPLING_ROWS = (1, 64, 200, 256)  # 200-256: the offline Qwen3-8B run's decode batches
SAMPLING_VOCAB = 151936  # Qwen3's


def _sampling_configs(splits: int) -> list[dict]:
    """The sweep's grid: 4 or 8 warps x half, once, twice and four times the default plan's splits."""
    return [
        {"num_warps": w, "num_splits": s}
        for w in (4, 8)
        for s in sorted({max(1, splits // 2), splits, 2 * splits, 4 * splits})
    ]


def bench_sampling(rows: tuple[int, ...] = SAMPLING_ROWS, vocab: int = SAMPLING_VOCAB, sweep: bool = False) -> None:
    """heron.kernels.sampling.sample_tokens on float32 logits [R, vocab], temperature 0.6, random seeds and
    counters, by CUDA-graph replay: without thresholds, with thresholds of -inf (every tile drawn, plus the
    skip test) and at each row's 50th largest logit (top-k 50: most tiles skipped). Each variant is first
    checked against sample_tokens_torch (the same tokens, bit for bit). G elem/s counts R * vocab logits.
    `sweep`: also `_sampling_configs` without thresholds."""
    from heron.executor.sampler import sample_tokens_torch
    from heron.kernels.sampling import default_plan, sample_tokens

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"sampling: {torch.cuda.get_device_name(dev)}, float32 logits, V={vocab}, T=0.6, CUDA-graph replay")
    for r in rows:
        logits = torch.randn(r, vocab, device=dev, generator=gen) * 3
        temp = torch.full((r,), 0.6, device=dev)
        seeds = torch.randint(-(2**63), 2**63 - 1, (r,), device=dev, generator=gen)
        ctrs = torch.randint(0, 2**40, (r,), device=dev, generator=gen)
        block, splits = default_plan(r, vocab, dev)
        variants = {
            "no thr": None,
            "thr -inf": torch.full((r,), float("-inf"), device=dev),
            "top-k 50": logits.topk(50, dim=-1).values[:, -1].contiguous(),
        }
        for name, thr in variants.items():
            ref = sample_tokens_torch(logits, temp, thr, seeds, ctrs)
            assert torch.equal(sample_tokens(logits, temp, thr, seeds, ctrs), ref), f"R={r} {name}: not the reference"
            t = _time_graph(lambda thr=thr: sample_tokens(logits, temp, thr, seeds, ctrs))
            print(
                f"  R={r:<3d} {name:8s} {t * 1e6:8.1f} us {r * vocab / t / 1e9:6.1f} G elem/s"
                f"  (block {block}, {splits} splits, 4 warps)"
            )
        if sweep:
            want = sample_tokens(logits, temp, None, seeds, ctrs)
            for cfg in _sampling_configs(splits):
                assert torch.equal(sample_tokens(logits, temp, None, seeds, ctrs, **cfg), want), cfg
                t = _time_graph(lambda cfg=cfg: sample_tokens(logits, temp, None, seeds, ctrs, **cfg))
                print(f"    sweep no thr {t * 1e6:8.1f} us {r * vocab / t / 1e9:6.1f} G elem/s  {cfg}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--vs-flashinfer", action="store_true", help="the recorded `kernels` benchmark: ours against FlashInfer"
    )
    ap.add_argument(
        "--save-result", action="store_true", help="with --vs-flashinfer: write benchmarks/results/kernels.json"
    )
    ap.add_argument(
        "--gemv",
        action="store_true",
        help="the decode GEMMs: heron.kernels.gemv against cuBLAS (with --sweep: search its configs)",
    )
    ap.add_argument("--prefill-only", action="store_true", help="only the paged prefill kernel (with --sweep: tune it)")
    ap.add_argument("--decode-only", action="store_true", help="only the paged decode kernel (with --sweep: tune it)")
    ap.add_argument(
        "--sampling",
        action="store_true",
        help="the one-pass sampler on Qwen3's vocabulary (with --sweep: other warps / splits)",
    )
    ap.add_argument("--only", help="with --gemv: only the models whose name contains this (qwen, llama)")
    ap.add_argument(
        "--rows",
        help=f"with --gemv / --sampling: comma-separated row counts (default: {','.join(map(str, GEMV_ROWS))} / "
        f"{','.join(map(str, SAMPLING_ROWS))})",
    )
    args = ap.parse_args()
    if args.sampling:
        rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else SAMPLING_ROWS
        bench_sampling(rows=rows, sweep=args.sweep)
        return
    if args.gemv:
        rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else GEMV_ROWS
        bench_gemv(sweep=args.sweep, only=args.only, rows=rows)
        return
    if args.vs_flashinfer:
        bench_vs_flashinfer(save=args.save_result, batch=args.batch)
        return
    if args.prefill_only:
        bench_prefill(sweep=args.sweep)
        return
    if args.decode_only:  # the `kernels` benchmark's case, offline Qwen3-8B decode steps (batch ~200, ~100), and
        # the offline run's spread of contexts (prompts 100-1024 tokens plus 0-1024 generated)
        for batch, lo, hi in (
            (args.batch, 1024, 2048),
            (200, 500, 1200),
            (100, 800, 1600),
            (200, 100, 2048),
            (100, 100, 2048),
            (80, 100, 2048),
            (48, 100, 2048),
        ):
            bench_decode(batch=batch, min_len=lo, max_len=hi, sweep=args.sweep)
        return
    bench_decode(batch=args.batch, sweep=args.sweep)
    bench_decode(batch=args.batch, head_dim=64, num_heads=32, num_kv_heads=8)
    bench_decode(batch=8, min_len=1024, max_len=2048)
    bench_decode(batch=args.batch, block_size=32)
    bench_prefill(sweep=args.sweep)


if __name__ == "__main__":
    main()
