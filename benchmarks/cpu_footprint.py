"""The embedded model on the CPU as a laptop runs it: `LLM()` with its defaults, then output tokens/s at batch 1
and 32 (64 sampled tokens each, T 0.7) and the process's peak RSS (the KV pool, the weights, the step's
temporaries). Each measurement runs in a fresh process. With --baseline-tree (an older checkout, e.g. from
`git archive`), the old and the new tree are measured alternately --repeats times in the same run and the medians
recorded side by side: a shared VM's memory bandwidth drifts by tens of percent between minutes. Records
benchmarks/results/cpu-footprint-smollm2.json with --save-result.

    PYTHONPATH=. python benchmarks/cpu_footprint.py [--baseline-tree /tmp/old --baseline-name ac15356] [--save-result]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from heron.bench.report import finish

BATCHES = (1, 32)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (kB on Linux)


def measure() -> dict[str, float]:
    """One process's figures: the metrics of the record, for the tree on this process's path."""
    from heron import LLM, SamplingParams

    llm = LLM()
    metrics = {"peak_rss_after_start_mb": peak_rss_mb()}
    params = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True, seed=1)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for batch in BATCHES:
        prompts = [f"Write a short story about robot number {i}." for i in range(batch)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        metrics[f"batch{batch}_output_tokens_per_s"] = tokens / (time.perf_counter() - start)
    metrics["peak_rss_mb"] = peak_rss_mb()
    return metrics


def measure_in(tree: Path) -> dict[str, float]:
    """`measure()` in a fresh interpreter that imports heron from `tree` (this file's code, that tree's engine)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = str(Path(__file__).resolve())
    code = f"import json, runpy; print(json.dumps(runpy.run_path({script!r})['measure']()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-tree", type=Path, help="an older checkout measured alternately with this one")
    parser.add_argument("--baseline-name", default="baseline", help="its name in the record (a commit)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-result", action="store_true")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    trees = {"": here} | ({args.baseline_name: args.baseline_tree.resolve()} if args.baseline_tree else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(measure_in(tree))
    metrics, rows = {"repeats": args.repeats}, []
    for name, tree_runs in runs.items():
        figures = medians(tree_runs)
        prefix = f"{name}_" if name else ""
        metrics |= {prefix + key: value for key, value in figures.items()}
        label = name or "this tree"
        rows.append(
            f"{label}: "
            + ", ".join(f"batch {b} {figures[f'batch{b}_output_tokens_per_s']:.1f} tokens/s" for b in BATCHES)
            + f", peak RSS {figures['peak_rss_mb']:.0f} MB (medians of {args.repeats})"
        )
    finish("cpu-footprint-smollm2", metrics, "cpu", "\n".join(rows), args.save_result)


if __name__ == "__main__":
    main()
