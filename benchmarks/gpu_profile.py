"""Where one engine step's time goes on the GPU: each phase timed with a device sync around it (so the
phases add up to the step, without overlap), for a batch-1 decode and a batch-256 decode (a decode step's
LM head runs inside its CUDA graph: "forward+rest" holds it); then, without
the syncs, the GPU kernels of a few batch-256 steps (torch.profiler) and the host-side gaps between them;
the kernels of a prefill step (one 128-token prompt, the latency benchmark's TTFT; and a full 8192-token
chunk); and the offline benchmark's workload step by step (wall time by kind of step and batch size). `many` and
`prefix` do the same for issue 23's and issue 26's workloads.

    python benchmarks/gpu_profile.py SHAPE_DIR [PART ...]   (parts: phases kernels prefill timeline many
    prefix; default all but many and prefix; `fp8` quantizes the weights as `--quantization fp8` does)
    python benchmarks/gpu_profile.py SHAPE_DIR lora ADAPTER_DIR ...   (issue 25's workload)
    python benchmarks/gpu_profile.py SHAPE_DIR structured TOKENIZER_DIR   (issue 20's workload)
"""

from __future__ import annotations

import bisect
import collections
import os
import sys
import time

import torch

from heron import LLM, SamplingParams
from heron.sampling_params import RequestOutputKind


def timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        table[name].append(time.perf_counter() - start)
        return out

    return wrapper


def profile(llm: LLM, batch: int, prompt_len: int, steps: int, temperature: float) -> None:
    engine, runner = llm.engine, llm.engine.runner
    table: dict[str, list[float]] = collections.defaultdict(list)
    originals = (engine.scheduler.schedule, runner._prepare, runner.sampler, engine._process, engine.step)
    engine.scheduler.schedule = timed(table, "schedule", engine.scheduler.schedule)
    runner._prepare = timed(table, "prepare inputs", runner._prepare)
    runner.sampler = timed(table, "sampler", runner.sampler)
    engine._process = timed(table, "read back+outputs", engine._process)
    engine.step = timed(table, "whole step", engine.step)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(
            f"p{batch}-{i}",
            torch.randint(0, 10000, (prompt_len,), generator=g).tolist(),
            SamplingParams(temperature=temperature, max_tokens=steps + 1, ignore_eos=True),
        )
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.schedule, runner._prepare, runner.sampler, engine._process, engine.step = originals
    whole = table["whole step"][-steps:]
    print(
        f"batch {batch}, prompt {prompt_len}, temperature {temperature}: {len(runner.graphs)} graphs; "
        f"median of the last {steps} steps (ms):"
    )
    for name, times in table.items():
        ts = sorted(times[-steps:])
        print(f"  {name:15s} {1000 * ts[len(ts) // 2]:8.3f}")
    parts = sum(sorted(table[n][-steps:])[steps // 2] for n in table if n != "whole step")
    print(f"  forward+rest    {1000 * (sorted(whole)[len(whole) // 2] - parts):8.3f}")


def kernel_table(llm: LLM, batch: int, prompt_len: int, steps: int, lora_request=None) -> None:
    """GPU time by kernel over `steps` unsynchronised decode steps, against their wall time (every request with
    `lora_request`, if given)."""
    engine = llm.engine
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        engine.add_request(
            f"k{i}",
            torch.randint(0, 10000, (prompt_len,), generator=g).tolist(),
            SamplingParams(
                temperature=0.6, max_tokens=steps + 8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            ),
            lora_request=lora_request,
        )
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profiler() as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    _print_kernels(prof, f"batch {batch} decode", wall, steps)
    while engine.has_unfinished():
        engine.step()


def _print_kernels(prof, label: str, wall: float, steps: int) -> None:
    """The GPU time by kernel of `steps` steps that took `wall` seconds, and the idle gaps between kernels."""
    events = prof.key_averages()
    gpu = sum(e.device_time_total for e in events) / 1e3
    print(f"{label}, {steps} steps: wall {1000 * wall / steps:.2f} ms/step, GPU kernels {gpu / steps:.2f} ms/step")
    print(events.table(sort_by="device_time_total", row_limit=15))
    gap_table(prof, steps)


def profiler() -> torch.profiler.profile:
    """The GPU's kernels; with HERON_PROFILE_HOST=1 the host's ops and CUDA runtime calls too (`gap_table` then
    says what the host did while the GPU idled; the host runs slower under it)."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if os.environ.get("HERON_PROFILE_HOST") == "1":
        activities.append(torch.profiler.ProfilerActivity.CPU)
    return torch.profiler.profile(activities=activities)


def gap_table(prof, steps: int, rows: int = 12) -> None:
    """Where the GPU idles between kernels: the idle time before each kernel, summed by (previous, next) kernel;
    under HERON_PROFILE_HOST=1, the host's ops and runtime calls that overlap the idle time of gaps over 50 us."""
    events = prof.events()
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    long_gaps: list[tuple[float, float]] = []
    for prev, nxt in zip(kernels, kernels[1:]):
        idle = max(0.0, nxt.time_range.start - prev.time_range.end)
        gaps[(prev.name[:40], nxt.name[:40])].append(idle)
        if idle > 50:
            long_gaps.append((prev.time_range.end, nxt.time_range.start))
    total = sum(sum(v) for v in gaps.values())
    print(
        f"idle between kernels: {total / 1e3 / steps:.3f} ms/step over {len(kernels) / steps:.0f} kernels/step; "
        f"largest by (previous -> next):"
    )
    for (a, b), v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"  {sum(v) / 1e3 / steps:7.3f} ms/step {len(v) / steps:6.1f}x {sum(v) / len(v):7.2f} us  {a} -> {b}")
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if host and long_gaps:
        _host_in_gaps(host, long_gaps, steps, rows)


def _host_in_gaps(host: list, gaps: list[tuple[float, float]], steps: int, rows: int) -> None:
    """The host events (ops and runtime calls, nested ones counted in each) overlapping the GPU's long idle gaps,
    by name: a sync, an allocation or a slow launch shows here."""
    starts = [a for a, _ in gaps]
    overlap: dict[str, float] = collections.defaultdict(float)
    for e in host:
        lo, hi = e.time_range.start, e.time_range.end
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(gaps) and gaps[i][0] < hi:
            overlap[e.name[:60]] += max(0.0, min(hi, gaps[i][1]) - max(lo, gaps[i][0]))
            i += 1
    idle = sum(b - a for a, b in gaps)
    print(f"host during the {len(gaps) / steps:.1f} idle gaps > 50 us a step ({idle / 1e3 / steps:.3f} ms/step):")
    for name, t in sorted(overlap.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {t / 1e3 / steps:7.3f} ms/step  {name}")


def prefill_table(llm: LLM, num_prompts: int, prompt_len: int) -> None:
    """GPU kernels and wall time of the one step that prefills `num_prompts` prompts of `prompt_len` tokens."""
    engine = llm.engine
    g = torch.Generator().manual_seed(2)
    for i in range(num_prompts):
        engine.add_request(
            f"f{prompt_len}-{i}",
            torch.randint(0, 10000, (prompt_len,), generator=g).tolist(),
            SamplingParams(max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY),
        )
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        start = time.perf_counter()
        engine.step()
        launched = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(
        f"prefill step, {num_prompts} x {prompt_len} tokens: wall {1000 * wall:.2f} ms (host returned after "
        f"{1000 * launched:.2f} ms, under the profiler), GPU kernels {gpu:.2f} ms, {kernels} kernel launches"
    )
    print(events.table(sort_by="device_time_total", row_limit=12))
    while engine.has_unfinished():
        engine.step()


def timeline(
    llm: LLM,
    profile_at: tuple[int, ...] = (200, 100),
    profile_steps: int = 8,
    requests: list | None = None,
    profile_from: tuple[int, ...] = (),
    loras: list | None = None,
    structured=None,
) -> list[int]:
    """The offline benchmark's workload (by default 256 requests, 100-1024 in / out) step by step: the wall
    time between step returns (the pipelined steady state), summed by kind of step and decode batch size. The
    first decode steps at or below each batch size of `profile_at` also run under torch.profiler (their
    kernels and idle gaps printed; the profiler slows those steps a little), and so do `profile_steps` steps
    from each step of `profile_from` whatever they are (a job's first prefill steps, its mixed ones). `loras`:
    LoRARequests that the requests take round robin; `structured`: StructuredOutputsParams every request takes.
    Returns the number of tokens each request generated."""
    from heron.bench.datasets import random_token_requests

    engine = llm.engine
    shapes: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        shapes.append((len(batch), batch.total_tokens))
        return batch

    engine.scheduler.schedule = recording
    requests = requests or random_token_requests()
    generated: dict[str, int] = {}
    for i, r in enumerate(requests):
        engine.add_request(
            f"t{i}",
            r.prompt_token_ids,
            SamplingParams(
                temperature=0.6,
                max_tokens=r.output_len,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
                structured_outputs=structured,
            ),
            lora_request=loras[i % len(loras)] if loras else None,
        )
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    pending, prof, left = sorted(profile_at, reverse=True), None, 0
    while engine.has_unfinished():
        decoding = shapes and shapes[-1][0] == shapes[-1][1]
        at_decode = pending and decoding and shapes[-1][0] <= pending[0]
        if prof is None and (at_decode or len(times) in profile_from):
            if at_decode:
                pending.pop(0)
            prof, left, first = (
                profiler(),
                profile_steps,
                len(times),
            )
            prof.start()
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
        now = time.perf_counter()
        times.append(now - start)
        left -= 1
        if prof is not None and left == 0:
            torch.cuda.synchronize()
            prof.stop()
            steps = ", ".join(
                f"{n} seqs / {t} tokens {1000 * dt:.1f} ms" for (n, t), dt in zip(shapes[first:], times[first:])
            )
            _print_kernels(
                prof,
                f"steps {first}..{len(times) - 1} ({steps}; context ~{_mean_context(engine):.0f})",
                sum(times[first:]),
                profile_steps,
            )
            prof = None
        start = time.perf_counter()
    engine.scheduler.schedule = schedule
    buckets: dict[str, list[float]] = collections.defaultdict(list)
    for (seqs, tokens), t in zip(shapes, times):
        kind = "decode" if tokens == seqs else "prefill/mixed"
        key = f"{kind} {min(256, 1 << (seqs - 1).bit_length()) if kind == 'decode' else tokens // 1024 * 1024:>5}"
        buckets[key].append(t)
    total = sum(times)
    print(
        f"offline workload: {len(times)} steps, {total:.2f} s; by kind (decode: batch size up to; prefill/mixed: "
        f"tokens from):"
    )
    for key in sorted(buckets):
        ts = buckets[key]
        print(
            f"  {key:22s} {len(ts):5d} steps {sum(ts):7.2f} s ({100 * sum(ts) / total:4.1f}%) "
            f"{1000 * sum(ts) / len(ts):8.2f} ms/step"
        )
    return [generated[f"t{i}"] for i in range(len(requests))]


def many(llm: LLM, num_prompts: int = 20000) -> None:
    """Issue 23's workload (short prompts and outputs, uniform [16, 64]): its timeline, then the host's
    Python under cProfile over a third of the requests (top functions by own time)."""
    import cProfile
    import pstats

    from heron.bench.datasets import random_token_requests

    workload = dict(input_len=(16, 64), output_len=(16, 64))
    timeline(llm, profile_at=(), requests=random_token_requests(num_prompts, **workload))
    requests = random_token_requests(num_prompts // 3, seed=1, **workload)
    params = [SamplingParams(temperature=0.6, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    profiler.disable()
    print(f"many under cProfile: {len(requests)} requests in {time.perf_counter() - start:.2f} s")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(35)


def prefix(llm: LLM) -> None:
    """Issue 26's workload (16 system prompts of 2,000 tokens x 32 requests, each + a 50-200 token question,
    outputs 64-256): its timeline, with the kernels of its first prefill steps (past the first), of eight steps
    from step 100 (mixed: waiting requests join as others finish) and of a few decode steps at batch 256 and
    128 (the cascade's prefix kernel beside the decode kernel), and how many decode and mixed steps ran the
    cascade."""
    from heron.bench.datasets import shared_prefix_requests

    backend = llm.engine.runner.backend
    prepare, steps = backend.prepare, collections.Counter()

    def counting(meta) -> None:
        prepare(meta)
        kind = "mixed" if meta.max_query_len > 1 else "decode"
        steps[kind, backend.runs_cascade(meta)] += 1

    backend.prepare = counting
    try:
        timeline(llm, profile_at=(256, 128), requests=shared_prefix_requests(), profile_from=(2, 100))
    finally:
        backend.prepare = prepare
    print("planned steps (kind, cascade): " + ", ".join(f"{k} {c}: {n}" for (k, c), n in sorted(steps.items())))


def lora(shape_dir: str, adapters: list[str]) -> None:
    """Issue 25's workload: the offline one with the adapters round robin (`gpu_check.sh lora` makes them), its
    timeline with the kernels of a few decode steps at batch 256 and 128 and of two prefill steps; then the
    kernels of batch-1 decode steps with one adapter (the latency benchmark's case)."""
    from heron.lora_request import LoRARequest

    llm = LLM(shape_dir, load_format="dummy", max_model_len=4096, enable_lora=True, max_loras=8, max_lora_rank=16)
    loras = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(adapters)]
    timeline(llm, profile_at=(256, 128), profile_from=(1,), profile_steps=2, loras=loras)
    kernel_table(llm, 1, 128, 20, lora_request=loras[0])


def structured(shape_dir: str, tokenizer: str) -> None:
    """Issue 20's workload: the offline one with every request under heron/bench/structured.py's JSON schema (the
    shapes' word-level tokenizers spell no JSON: `tokenizer`, a real one), its timeline with the kernels and the
    GPU's idle gaps of a few decode steps at batch 256, 128 and 4 (where a grammar step waits on the host); then
    the same requests unconstrained, each asked for the tokens its constrained run generated (as
    heron/bench/structured.py's second arm, the prefix cache reset), with the same profiled batch sizes: the
    two timelines' steps by kind say where the constrained run's extra time goes."""
    from heron.bench.datasets import BenchRequest, random_token_requests
    from heron.bench.structured import SCHEMA
    from heron.sampling_params import StructuredOutputsParams

    llm = LLM(shape_dir, load_format="dummy", max_model_len=4096, tokenizer=tokenizer)
    requests = random_token_requests()
    print("== under the JSON schema")
    lengths = timeline(llm, (256, 128, 4), requests=requests, structured=StructuredOutputsParams(json=SCHEMA))
    print("== unconstrained, the same output lengths")
    llm.reset_prefix_cache()  # (its prompts would be the first arm's cache hits)
    timeline(llm, (256, 128, 4), requests=[BenchRequest(r.prompt_token_ids, n) for r, n in zip(requests, lengths)])


def _mean_context(engine) -> float:
    running = engine.scheduler.running
    return sum(len(s.token_ids) for s in running) / max(1, len(running))


def main(shape_dir: str, parts: list[str]) -> None:
    if parts[0] == "lora":
        return lora(shape_dir, parts[1:])
    if parts[0] == "structured":
        return structured(shape_dir, parts[1])
    quantization = "fp8" if "fp8" in parts else None  # issue 24: the FP8 checkpoint's steps
    kv_cache_dtype = "fp8" if "kvfp8" in parts else "auto"  # and with the float8 KV cache
    llm = LLM(
        shape_dir, load_format="dummy", max_model_len=4096, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    if "phases" in parts:
        for batch, temperature in ((1, 0.0), (1, 0.6), (256, 0.6)):
            profile(llm, batch, 512, 64, temperature)
    if "kernels" in parts:
        kernel_table(llm, 256, 512, 10)
        kernel_table(llm, 1, 128, 20)
    if "prefill" in parts:
        for num_prompts, prompt_len in ((1, 128), (1, 128), (16, 512)):  # the first 128 warms up
            prefill_table(llm, num_prompts, prompt_len)
    if "timeline" in parts:
        timeline(llm)
    if "many" in parts:
        many(llm)
    if "prefix" in parts:
        prefix(llm)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["phases", "kernels", "prefill", "timeline"])
