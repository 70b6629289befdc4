"""Multi-LoRA under load (`heron bench throughput --lora-adapters DIR ...`): the workload's requests with the
adapters assigned round robin (request i runs adapter i mod N) on an engine built with --enable-lora, then the
same requests on the base model alone (an engine without LoRA), in the same run: `ratio_vs_base` is the ratio
of their output tokens/s, with each engine's KV-cache blocks beside it (a base engine given less cache than the
adapters' one would flatter them: a warning says so). Each arm runs in a process of its own: a GPU segment the
first engine's KV cache leaves cached in the process is not always returned by `empty_cache` (torch 2.11, H100
and H200), and the second engine's weights, placed inside it, left its KV cache a quarter of the first's.
`benchmarks/make_loras.py` writes random adapters for a shapes folder (--load-format dummy)."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from heron.bench.datasets import BenchRequest

logger = logging.getLogger(__name__)


def time_generate(llm, requests: list[BenchRequest], temperature: float, sync, lora_requests=None) -> float:
    """Seconds of one `generate` call over the requests (after a warm-up that reads and loads every adapter)."""
    from heron.sampling_params import SamplingParams

    warm = lora_requests[: llm.engine.config.lora.max_loras] if lora_requests else [None]
    llm.generate([list(range(1, 33))] * len(warm), SamplingParams(max_tokens=16), use_tqdm=False, lora_request=warm)
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    sync(llm)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False, lora_request=lora_requests)
    sync(llm)
    seconds = time.perf_counter() - start
    got, want = sum(len(o.outputs[0].token_ids) for o in outs), sum(r.output_len for r in requests)
    if got != want:
        raise RuntimeError(f"Heron generated {got} output tokens, the workload asks for {want}.")
    return seconds


def time_arm(
    args: argparse.Namespace, requests: list[BenchRequest], make_llm: Callable, sync
) -> tuple[float, int, str]:
    """One arm (the adapters' when args.enable_lora, else the base model's): its seconds, its engine's KV-cache
    blocks and the model's slug. Runs in the arm's own process (time_both), its engine's logs as the parent's."""
    from heron.bench.cli import model_slug
    from heron.lora_request import LoRARequest

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = make_llm(args)
    adapters = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(args.lora_adapters)]
    round_robin = [adapters[i % len(adapters)] for i in range(len(requests))] if args.enable_lora else None
    seconds = time_generate(llm, requests, args.temperature, sync, round_robin)
    return seconds, llm.engine.block_manager.num_blocks, model_slug(llm)


def time_both(args: argparse.Namespace, requests: list[BenchRequest], make_llm: Callable, sync) -> tuple[dict, str]:
    """The adapters' arm, then the base model's, each in a new process; returns the metrics and the model's slug."""
    if not args.enable_lora:
        raise SystemExit("--lora-adapters needs --enable-lora (and --max-loras, --max-lora-rank to fit them)")
    spawn = multiprocessing.get_context("spawn")
    flags = {k: v for k, v in vars(args).items() if k not in ("func", "command_parser")}  # (the CLI's, unpicklable)
    arms = []
    for arm_args in (argparse.Namespace(**flags), argparse.Namespace(**{**flags, "enable_lora": False})):
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            arms.append(pool.submit(time_arm, arm_args, requests, make_llm, sync).result())
    (lora_s, kv_blocks, slug), (base_s, base_kv_blocks, _) = arms
    if base_kv_blocks < kv_blocks:
        logger.warning(
            "the base model's engine has fewer KV-cache blocks (%d) than the adapters' (%d)", base_kv_blocks, kv_blocks
        )
    tokens = sum(r.output_len for r in requests)
    metrics = {
        "output_tokens_per_s": tokens / lora_s,
        "base_output_tokens_per_s": tokens / base_s,
        "ratio_vs_base": base_s / lora_s,
        "elapsed_s": lora_s,
        "base_elapsed_s": base_s,
        "num_requests": len(requests),
        "output_tokens": tokens,
        "kv_blocks": kv_blocks,
        "base_kv_blocks": base_kv_blocks,
        "num_adapters": len(args.lora_adapters),
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
    }
    return metrics, slug
