"""Why a second engine built in a process after a first one was deleted finds its KV cache's memory stranded
(`heron bench throughput --lora-adapters` built its two arms so until it gave each its own process): the LoRA
arm, then the base arm, in this process, with the CUDA allocator's history on. As each engine places its weights
(after its start's gc.collect and empty_cache) and as it sizes its KV cache, this lists the process's large
segments (pool, size, in use) with where their live blocks were allocated, and any earlier ModelRunner alive.
Session 32 (H200): the first engine's 107.76 GiB KV segment, wholly free, was still cached when the second
engine placed its weights, and no earlier ModelRunner was alive.
  python benchmarks/leak_probe.py <bench throughput arguments with --lora-adapters...>"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from heron.bench.cli import make_llm
from heron.bench.datasets import random_token_requests
from heron.bench.lora import time_arm
from heron.bench.throughput import _sync
from heron.entrypoints.cli import build_parser
from heron.executor.model_runner import ModelRunner

GiB = 2**30


def _frames(block: dict) -> str:
    own = [f for f in block.get("frames", []) if "/heron/" in f["filename"]][:4]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in own) or "?"


def report(label: str, runner: ModelRunner) -> None:
    print(
        f"--- {label}: allocated {torch.cuda.memory_allocated() / GiB:.2f} GiB, "
        f"reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB, driver free {torch.cuda.mem_get_info()[0] / GiB:.2f}"
    )
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["total_size"] < 256 << 20:
            continue
        print(
            f"  segment {seg['total_size'] / GiB:.2f} GiB, pool {seg['segment_pool_id']}, "
            f"allocated {seg['allocated_size'] / GiB:.2f}, active {seg['active_size'] / GiB:.2f}"
        )
        live = [b for b in seg["blocks"] if b["state"] != "inactive" and b["size"] >= 64 << 20]
        for b in sorted(live, key=lambda b: -b["size"])[:4]:
            print(f"    {b['state']} {b['size'] / GiB:.2f} GiB from {_frames(b)}")
    gc.collect()
    for other in (o for o in gc.get_objects() if isinstance(o, ModelRunner) and o is not runner):
        print(f"  an earlier ModelRunner is alive, held by {[type(r).__name__ for r in gc.get_referrers(other)][:8]}")


def probe(method: str) -> None:
    original = getattr(ModelRunner, method)

    def wrapped(self, *args, **kwargs):
        report(f"before {method}", self)
        result = original(self, *args, **kwargs)
        report(f"after {method}", self)
        return result

    setattr(ModelRunner, method, wrapped)


if __name__ == "__main__":
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    probe("_load_model")
    probe("_profile_free_memory")
    args = build_parser().parse_args(["bench", "throughput", *sys.argv[1:]])
    requests = random_token_requests(
        args.num_prompts, args.input_len_range, args.output_len_range, args.seed, args.max_token_id
    )
    for enable_lora in (True, False):
        arm = argparse.Namespace(**{**vars(args), "enable_lora": enable_lora})
        seconds, blocks, _ = time_arm(arm, requests, make_llm, _sync)
        print(f"=== {'LoRA' if enable_lora else 'base'} arm: {seconds:.2f} s, {blocks} KV-cache blocks")
