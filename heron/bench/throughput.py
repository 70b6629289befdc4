"""Offline throughput: the random-token workload through `LLM.generate`, against the hardware and transformers.

The workload (heron/bench/datasets.py) defaults to the anchors' one: 256 requests, prompt and output lengths
uniform in [100, 1024], token ids in [0, 10000], seed 0, ignore_eos, temperature 0.6. Heron runs it in one
`generate` call after a warm-up request; output tokens/s = output tokens / the call's wall time.

In the same run: the physical limit (heron/bench/roofline.py: the bytes any engine must move over the
measured copy bandwidth, or the FLOPs over the measured matmul rate, whichever is slower), and with
--hf-baseline transformers `generate` on the same requests (heron/bench/hf_baseline.py: static batches of
--hf-batch-size sorted by output length, left padding; only each request's own output tokens count).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time

from heron.bench.cli import add_engine_args, add_result_args, make_llm, model_slug
from heron.bench.datasets import BenchRequest, parse_range, random_token_requests, shared_prefix_requests
from heron.bench.gpu_monitor import maybe_monitor
from heron.bench.report import finish, format_table


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    w = parser.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=256)
    w.add_argument("--input-len-range", type=parse_range, default=(100, 1024), metavar="LOW,HIGH")
    w.add_argument("--output-len-range", type=parse_range, default=(100, 1024), metavar="LOW,HIGH")
    w.add_argument("--max-token-id", type=int, default=10000, help="prompt token ids are uniform in [0, this]")
    w.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="the prefix workload: requests open with one of --num-shared-prefixes system prompts of this many "
        "tokens, then a question of --input-len-range tokens (datasets.shared_prefix_requests)",
    )
    w.add_argument("--num-shared-prefixes", type=int, default=16)
    w.add_argument("--temperature", type=float, default=0.6)
    w.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    w.add_argument(
        "--structured-output",
        choices=["json-schema"],
        default=None,
        help="every request under a JSON schema, against the same requests unconstrained (heron/bench/structured.py)",
    )
    w.add_argument(
        "--lora-adapters",
        nargs="+",
        default=None,
        metavar="DIR",
        help="PEFT adapters assigned to the requests round robin (with --enable-lora), against the same requests on "
        "the base model alone (heron/bench/lora.py)",
    )
    b = parser.add_argument_group("baselines")
    b.add_argument("--hf-baseline", action="store_true", help="also time transformers generate on the same requests")
    b.add_argument("--hf-batch-size", type=int, default=None, help="static batch size (default: --batch-size)")
    b.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="run transformers on an evenly spaced subset of this many requests (default: all)",
    )
    b.add_argument(
        "--no-limit",
        dest="limit",
        action="store_false",
        help="skip measuring copy bandwidth and matmul rate for the physical limit",
    )
    add_result_args(parser, "[cpu-]offline-<model>")


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0


def time_heron(llm, requests: list[BenchRequest], temperature: float, progress: bool = False) -> tuple[float, int]:
    """(seconds, output tokens) of one `generate` call over the requests, after a warm-up request."""
    from heron.sampling_params import SamplingParams

    params = lambda n: SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)
    llm.generate([list(range(1, 33))], params(16), use_tqdm=False)
    _sync(llm)
    start = time.perf_counter()
    outs = llm.generate(
        [r.prompt_token_ids for r in requests], [params(r.output_len) for r in requests], use_tqdm=progress
    )
    _sync(llm)
    seconds = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(r.output_len for r in requests)
    if got != want:
        raise RuntimeError(f"Heron generated {got} output tokens, the workload asks for {want}.")
    return seconds, got


CPU_TOKENS_HINT = 50_000  # tokens (prompt + output) past which the default workload takes hours on a CPU


def _cpu_hint(requests: list[BenchRequest]) -> None:
    """The default workload is sized for a GPU; on a CPU, say so before hours go by."""
    tokens = sum(len(r.prompt_token_ids) + r.output_len for r in requests)
    if tokens > CPU_TOKENS_HINT:
        print(
            f"hint: this workload is {tokens:,} tokens, sized for a GPU; on the CPU it can take hours. A quick run: "
            "--num-prompts 16 --input-len-range 32,128 --output-len-range 32,128",
            file=sys.stderr,
            flush=True,
        )


def _sync(llm) -> None:
    import torch

    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize(llm.engine.device)


def _run_structured(args: argparse.Namespace, llm, requests: list[BenchRequest], device) -> dict:
    from heron.bench.structured import time_both

    metrics = time_both(llm, requests, args.temperature, _sync)
    name = args.result_name or f"{'cpu-' if device.type == 'cpu' else ''}structured-{model_slug(llm)}"
    rows = [
        ("Heron, every request under the JSON schema", metrics["output_tokens"], metrics["elapsed_s"]),
        ("Heron, unconstrained, the same output lengths", metrics["output_tokens"], metrics["unconstrained_elapsed_s"]),
    ]
    rows = [(*r, r[1] / r[2], None) for r in rows]
    table = format_table(rows, ("run", "output tokens", "seconds", "output tokens/s", "Heron / this"))
    m = metrics
    header = (
        f"{name}: {len(requests)} requests, ratio vs unconstrained {m['ratio_vs_unconstrained']:.3f}, "
        f"schema compile {m['compile_cold_s'] * 1e3:.1f} ms cold, {m['compile_cached_s'] * 1e3:.3f} ms cached"
    )
    return finish(name, metrics, device, header + "\n" + table, args.save_result, args.results_dir, None)


def _run_lora(args: argparse.Namespace, requests: list[BenchRequest], device) -> dict:
    from heron.bench.lora import time_both

    metrics, slug = time_both(args, requests, make_llm, _sync)
    name = args.result_name or f"{'cpu-' if device.type == 'cpu' else ''}lora-{slug}"
    m = metrics
    rows = [
        (f"Heron, {m['num_adapters']} adapters round robin", m["output_tokens"], m["elapsed_s"], None, None),
        ("Heron, the base model alone", m["output_tokens"], m["base_elapsed_s"], None, m["ratio_vs_base"]),
    ]
    rows = [(r[0], r[1], r[2], r[1] / r[2], r[4]) for r in rows]
    table = format_table(rows, ("run", "output tokens", "seconds", "output tokens/s", "Heron / this"))
    header = f"{name}: {len(requests)} requests, ratio vs base {m['ratio_vs_base']:.3f}"
    return finish(name, metrics, device, header + "\n" + table, args.save_result, args.results_dir, None)


def run(args: argparse.Namespace) -> dict:
    import torch

    from heron.bench.hf_baseline import load_hf_model, run_hf
    from heron.bench.roofline import ModelCost, copy_bandwidth, matmul_rate, workload_bound
    from heron.config import resolve_device, resolve_dtype

    if args.shared_prefix_len:
        requests = shared_prefix_requests(
            args.num_prompts,
            args.num_shared_prefixes,
            args.shared_prefix_len,
            args.input_len_range,
            args.output_len_range,
            args.seed,
            args.max_token_id,
        )
    else:
        requests = random_token_requests(
            args.num_prompts, args.input_len_range, args.output_len_range, args.seed, args.max_token_id
        )
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cpu":
        _cpu_hint(requests)
    # The machine's rates first, while the engine does not yet hold the device's memory.
    bandwidth = copy_bandwidth(device) if args.limit else None
    flop_rate = matmul_rate(device, dtype) if args.limit else None
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if args.lora_adapters:
        return _run_lora(args, requests, device)
    llm = make_llm(args)
    if args.structured_output:
        return _run_structured(args, llm, requests, device)
    batch = llm.engine.config.scheduler.max_num_seqs
    monitor = maybe_monitor(args.gpu_monitor)
    with monitor or contextlib.nullcontext():
        seconds, out_tokens = time_heron(llm, requests, args.temperature, progress=not args.disable_tqdm)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    print(f"Heron: {out_tokens} output tokens in {seconds:.2f} s = {out_tokens / seconds:,.1f} tokens/s", flush=True)
    cost = ModelCost.of(llm.engine.runner.model, llm.engine.model_cfg, llm.engine.runner.kv_dtype)
    kv_tokens = llm.engine.block_manager.num_blocks * llm.engine.block_manager.block_size  # KV capacity
    workload = "offline-prefix" if args.shared_prefix_len else "offline"
    name = args.result_name or f"{'cpu-' if device.type == 'cpu' else ''}{workload}-{model_slug(llm)}"
    del llm  # its KV cache holds most of a GPU's memory, which transformers needs next
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    metrics = {
        "output_tokens_per_s": out_tokens / seconds,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / seconds,
        "elapsed_s": seconds,
        "num_requests": len(requests),
        "batch_size": batch,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_tokens": kv_tokens,
        "cascade_attn": not args.disable_cascade_attn,
    }
    if args.shared_prefix_len:
        metrics.update(shared_prefix_len=args.shared_prefix_len, num_shared_prefixes=args.num_shared_prefixes)
    rows = [(f"Heron, max {batch} sequences per step", out_tokens, seconds, out_tokens / seconds, None)]
    if args.limit:
        lengths = [(len(r.prompt_token_ids), r.output_len) for r in requests]
        shared = (args.shared_prefix_len, [r.prefix_id for r in requests]) if args.shared_prefix_len else None
        bound = workload_bound(cost, lengths, batch, bandwidth, flop_rate, shared)
        limit = out_tokens / bound.min_seconds
        metrics.update(
            limit_output_tokens_per_s=limit,
            fraction_of_limit=metrics["output_tokens_per_s"] / limit,
            limit_bound_by=bound.bound_by,
            copy_bandwidth_GBps=bandwidth / 1e9,
            matmul_TFLOPs=flop_rate / 1e12,
        )
        rows.append(
            (
                f"physical limit ({bound.bound_by}: {bandwidth / 1e9:,.1f} GB/s copy, "
                f"{flop_rate / 1e12:,.2f} TFLOP/s matmul)",
                out_tokens,
                bound.min_seconds,
                limit,
                metrics["fraction_of_limit"],
            )
        )
    if args.hf_baseline:
        hf_batch = args.hf_batch_size or batch
        subset = requests
        if args.hf_num_prompts and args.hf_num_prompts < len(requests):
            k = args.hf_num_prompts
            subset = [requests[i * len(requests) // k] for i in range(k)]
        hf = load_hf_model(args.model, dtype, device, args.load_format)
        hf_run = run_hf(hf, subset, hf_batch, args.temperature, args.seed)
        del hf
        hf_rate = hf_run.output_tokens_per_s
        metrics.update(
            hf_output_tokens_per_s=hf_rate,
            ratio_vs_hf=metrics["output_tokens_per_s"] / hf_rate,
            hf_elapsed_s=hf_run.seconds,
            hf_num_requests=hf_run.num_requests,
            hf_batch_size=hf_batch,
            hf_output_tokens=hf_run.output_tokens,
            hf_generated_tokens=hf_run.generated_tokens,
        )
        rows.append(
            (
                f"transformers generate, static batches of {hf_batch}"
                + (f", {hf_run.num_requests} of the requests" if subset is not requests else ""),
                hf_run.output_tokens,
                hf_run.seconds,
                hf_rate,
                metrics["ratio_vs_hf"],
            )
        )
    table = format_table(rows, ("run", "output tokens", "seconds", "output tokens/s", "Heron / this"))
    prefix = (
        f"{args.num_shared_prefixes} shared prompts of {args.shared_prefix_len} tokens + "
        if args.shared_prefix_len
        else ""
    )
    header = (
        f"{name}: {len(requests)} requests, prompts {prefix}{args.input_len_range[0]}-{args.input_len_range[1]}, "
        f"outputs {args.output_len_range[0]}-{args.output_len_range[1]} tokens, {device}, {metrics['dtype']}"
    )
    return finish(name, metrics, device, header + "\n" + table, args.save_result, args.results_dir, monitor)
