"""Timing helpers the kernel micro-benchmarks share (GPU): CUDA-graph replay, random paged batches, compiling a
sweep's configs ahead in worker processes."""

from __future__ import annotations

import time

import torch


def paged_batch(seq_lens, block_size, num_kv_heads, head_dim, device, gen):
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


def time_graph(fn, iters: int = 50) -> float:
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


def time_eager(fn, iters: int = 5) -> float:
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


def time_configs(configs: list[dict], call, rate, iters: int, best: bool) -> None:
    """Time call(cfg) per config by graph replay and print each with rate(seconds); configs that do not
    compile (shared memory) are reported and skipped; `best`: print the five fastest."""
    results = []
    for cfg in configs:
        try:
            t = time_graph(lambda cfg=cfg: call(cfg), iters=iters)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
            continue
        results.append((t, cfg))
        print(f"  {cfg}: {t * 1e6:8.1f} us  {rate(t)}")
    if best and results:
        results.sort(key=lambda r: r[0])
        print("  best:", [f"{t * 1e6:.1f} us {c}" for t, c in results[:5]])


def _compile_one(build, configs: list) -> None:
    call = build()
    for cfg in configs:
        try:
            call(cfg)
        except Exception:  # noqa: BLE001 - the timing loop reports configs that do not compile
            pass
    torch.cuda.synchronize()


def compile_ahead(build, configs: list, workers: int = 12) -> None:
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
