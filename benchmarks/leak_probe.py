"""Whether an LLM's GPU memory is all released once it is deleted (as `heron bench throughput --lora-adapters`
relies on: it builds the base model's engine after the adapters'): live CUDA tensors and what holds them."""

from __future__ import annotations

import gc
import sys

import torch

from heron.entrypoints.llm import LLM
from heron.lora_request import LoRARequest
from heron.sampling_params import SamplingParams


def report(label: str) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    print(
        f"{label}: allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
        f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB"
    )
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda and o.numel() > 1 << 20]
    largest = sorted(live, key=lambda t: -t.untyped_storage().nbytes())[:8]
    for t in largest:
        holders = [type(r).__name__ for r in gc.get_referrers(t) if r is not live and r is not largest][:6]
        print(f"  live {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.0f} MiB, held by {holders}")


def main(model: str, loras: str) -> None:
    adapters = [LoRARequest(f"l{i}", i + 1, f"{loras}/lora{i}") for i in range(2)]
    llm = LLM(model, load_format="dummy", max_model_len=2048, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.generate([list(range(1, 64))] * 8, SamplingParams(max_tokens=8), use_tqdm=False, lora_request=adapters * 4)
    report("with the engine")
    del llm
    report("after del")


if __name__ == "__main__":
    main(*sys.argv[1:])
