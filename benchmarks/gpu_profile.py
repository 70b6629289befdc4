"""Where one engine step's time goes on the GPU: each phase timed with a device sync around it (so the
phases add up to the step, without overlap), for a batch-1 decode and a batch-256 decode (a decode step's
LM head runs inside its CUDA graph: "forward+rest" holds it); then, without
the syncs, the GPU kernels of a few batch-256 steps (torch.profiler) and the host-side gaps between them.

    python benchmarks/gpu_profile.py SHAPE_DIR
"""

from __future__ import annotations

import collections
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
        engine.add_request(f"p{batch}-{i}", torch.randint(0, 10000, (prompt_len,), generator=g).tolist(),
                           SamplingParams(temperature=temperature, max_tokens=steps + 1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.schedule, runner._prepare, runner.sampler, engine._process, engine.step = originals
    whole = table["whole step"][-steps:]
    print(f"batch {batch}, prompt {prompt_len}, temperature {temperature}: {len(runner.graphs)} graphs; "
          f"median of the last {steps} steps (ms):")
    for name, times in table.items():
        ts = sorted(times[-steps:])
        print(f"  {name:15s} {1000 * ts[len(ts) // 2]:8.3f}")
    print(f"  forward+rest    {1000 * (sorted(whole)[len(whole) // 2] - sum(sorted(table[n][-steps:])[steps // 2] for n in table if n != 'whole step')):8.3f}")


def kernel_table(llm: LLM, batch: int, prompt_len: int, steps: int) -> None:
    """GPU time by kernel over `steps` unsynchronised decode steps, against their wall time."""
    engine = llm.engine
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        engine.add_request(f"k{i}", torch.randint(0, 10000, (prompt_len,), generator=g).tolist(),
                           SamplingParams(temperature=0.6, max_tokens=steps + 8, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu = sum(e.device_time_total for e in events) / 1e3
    print(f"batch {batch} decode, {steps} steps: wall {1000 * wall / steps:.2f} ms/step, GPU kernels "
          f"{gpu / steps:.2f} ms/step (the rest is host time the GPU waits for)")
    print(events.table(sort_by="device_time_total", row_limit=15))
    while engine.has_unfinished():
        engine.step()


def main(shape_dir: str) -> None:
    llm = LLM(shape_dir, load_format="dummy", max_model_len=4096)
    for batch, temperature in ((1, 0.0), (1, 0.6), (256, 0.6)):
        profile(llm, batch, 512, 64, temperature)
    kernel_table(llm, 256, 512, 10)
    kernel_table(llm, 1, 128, 20)


if __name__ == "__main__":
    main(sys.argv[1])
