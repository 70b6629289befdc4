"""The embedded model on the CPU as a laptop runs it: `LLM()` with its defaults, then output tokens/s at batch 1
and 32 (64 sampled tokens each, T 0.7) and the process's peak RSS (the KV pool, the weights, the step's
temporaries). Records benchmarks/results/cpu-footprint-smollm2.json with --save-result.

    PYTHONPATH=. python benchmarks/cpu_footprint.py [--save-result]
"""

from __future__ import annotations

import argparse
import resource
import time

from heron import LLM, SamplingParams
from heron.bench.report import finish


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (kB on Linux)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save-result", action="store_true")
    args = parser.parse_args()
    llm = LLM()
    metrics = {"peak_rss_after_start_mb": peak_rss_mb()}
    params = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True, seed=1)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rows = []
    for batch in (1, 32):
        prompts = [f"Write a short story about robot number {i}." for i in range(batch)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        metrics[f"batch{batch}_output_tokens_per_s"] = tokens / seconds
        rows.append(f"batch {batch}: {tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.1f} tokens/s")
    metrics["peak_rss_mb"] = peak_rss_mb()
    rows.append(f"peak RSS {metrics['peak_rss_mb']:.0f} MB ({metrics['peak_rss_after_start_mb']:.0f} MB after start)")
    finish("cpu-footprint-smollm2", metrics, "cpu", "\n".join(rows), args.save_result)


if __name__ == "__main__":
    main()
