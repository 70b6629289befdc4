"""Where one engine step's time goes on the GPU: each phase timed with a device sync around it (so the
phases add up to the step, without overlap), for a batch-1 decode and a batch-256 decode.

    python benchmarks/gpu_profile.py SHAPE_DIR
"""

from __future__ import annotations

import collections
import sys
import time

import torch

from heron import LLM, SamplingParams


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
    originals = (engine.scheduler.schedule, runner._prepare, runner.sampler, runner._to_host, runner.model.compute_logits,
                 engine.step)
    engine.scheduler.schedule = timed(table, "schedule", engine.scheduler.schedule)
    runner._prepare = timed(table, "prepare inputs", runner._prepare)
    runner.sampler = timed(table, "sampler", runner.sampler)
    runner._to_host = timed(table, "to host", runner._to_host)
    runner.model.compute_logits = timed(table, "lm head", runner.model.compute_logits)
    engine.step = timed(table, "whole step", engine.step)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", torch.randint(0, 10000, (prompt_len,), generator=g).tolist(),
                           SamplingParams(temperature=temperature, max_tokens=steps + 1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    (engine.scheduler.schedule, runner._prepare, runner.sampler, runner._to_host, runner.model.compute_logits,
     engine.step) = originals
    whole = table["whole step"][-steps:]
    print(f"batch {batch}, prompt {prompt_len}, temperature {temperature}: {len(runner.graphs)} graphs; "
          f"median of the last {steps} steps (ms):")
    for name, times in table.items():
        ts = sorted(times[-steps:])
        print(f"  {name:15s} {1000 * ts[len(ts) // 2]:8.3f}")
    print(f"  forward+rest    {1000 * (sorted(whole)[len(whole) // 2] - sum(sorted(table[n][-steps:])[steps // 2] for n in table if n != 'whole step')):8.3f}")


def main(shape_dir: str) -> None:
    llm = LLM(shape_dir, load_format="dummy", max_model_len=4096)
    for batch, temperature in ((1, 0.0), (1, 0.6), (256, 0.6)):
        profile(llm, batch, 512, 64, temperature)


if __name__ == "__main__":
    main(sys.argv[1])
