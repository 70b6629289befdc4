"""Why the second engine of `heron bench throughput --lora-adapters` (built after the adapters' one in the same
process) finds its KV cache's memory stranded: the bench's command runs as given, with the CUDA allocator's
history on, and as each engine places its weights (after its start's gc.collect and empty_cache) and again as
it sizes its KV cache, this lists the process's large segments (pool, size, in use) with where their live
blocks were allocated, and any earlier ModelRunner still alive with what holds it.
  python benchmarks/leak_probe.py <bench throughput arguments...>"""

from __future__ import annotations

import gc
import sys

import torch

from heron.entrypoints.cli import main
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
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
