"""Single-request latency: one request of --input-len random prompt tokens and exactly --output-len output tokens.

Decode ms per token = (last token time - first token time) / (output tokens - 1), from the request's own
metrics; output tokens/s = output tokens / the whole `generate` call (prefill included). Each of
--num-iters runs uses a fresh prompt (no prefix-cache hits); the median run is reported, after a warm-up.
On CUDA the roofline of a decode step is measured in the same run: it must read every weight once
(heron/bench/roofline.py says which; of a mixture of experts, the k experts the token picks in each layer),
so it takes at least those weight bytes / copy bandwidth, and roofline_fraction = that time / the measured
decode ms per token.

With --prefill: a batch of --batch-size prompts (default 8) of --input-len tokens (default 2048), one output
token each, and its prefill tokens/s and mfu (heron/bench/prefill.py).
"""

from __future__ import annotations

import argparse
import contextlib
import time

from heron.bench import prefill
from heron.bench.cli import add_engine_args, add_result_args, make_llm, model_slug
from heron.bench.datasets import random_token_requests
from heron.bench.gpu_monitor import maybe_monitor
from heron.bench.report import finish, format_table


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--prefill",
        action="store_true",
        help="time a batch of --batch-size prompts with one output token each, and its mfu",
    )
    w.add_argument("--input-len", type=int, default=None, help="prompt tokens (default: 128; with --prefill 2048)")
    w.add_argument("--output-len", type=int, default=None, help="output tokens (default: 256; not with --prefill)")
    w.add_argument("--num-iters", type=int, default=3)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--max-token-id", type=int, default=10000, help="prompt token ids are uniform in [0, this]")
    w.add_argument(
        "--lora-adapter",
        default=None,
        metavar="DIR",
        help="run every request with this PEFT adapter (with --enable-lora): its decode overhead against a run without",
    )
    parser.add_argument("--hf-baseline", action="store_true", help="also time transformers generate (batch 1)")
    add_result_args(parser, "[cpu-]latency-<model>-bs1; with --prefill [cpu-]prefill-<model>")


def main(args: argparse.Namespace) -> int:
    fill_workload_defaults(args)
    (prefill.run if args.prefill else run)(args)
    return 0


def fill_workload_defaults(args: argparse.Namespace) -> None:
    """The flags left out take the mode's defaults: the prefill batch of issue 4 (8 x 2048) with
    --prefill, else one request of 128 + 256 tokens on the engine's default --max-num-seqs."""
    if args.prefill and (args.output_len is not None or args.hf_baseline):
        raise ValueError(
            "--prefill asks for one output token and has no transformers baseline: leave out "
            "--output-len and --hf-baseline."
        )
    if args.num_iters < 1:
        raise ValueError(f"--num-iters must be at least 1, got {args.num_iters}.")
    if args.max_num_seqs is None and args.prefill:
        args.max_num_seqs = 8
    if args.input_len is None:
        args.input_len = 2048 if args.prefill else 128
    if args.output_len is None and not args.prefill:
        args.output_len = 256


def run(args: argparse.Namespace) -> dict:
    import torch

    from heron.bench.roofline import ModelCost, copy_bandwidth
    from heron.config import resolve_device, resolve_dtype
    from heron.lora_request import LoRARequest
    from heron.sampling_params import SamplingParams

    if args.output_len < 2:
        raise ValueError(f"--output-len must be at least 2 to time decoding, got {args.output_len}.")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    prompts = [
        r.prompt_token_ids
        for r in random_token_requests(
            args.num_iters + 1, (args.input_len, args.input_len), (1, 1), args.seed, args.max_token_id
        )
    ]
    llm = make_llm(args)
    lora = None if args.lora_adapter is None else LoRARequest("adapter", 1, args.lora_adapter)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=args.output_len)
    runs = []
    monitor = maybe_monitor(args.gpu_monitor)
    with monitor or contextlib.nullcontext():
        for i, prompt in enumerate(prompts):  # the first is the warm-up
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
            total = time.perf_counter() - start
            m = out.metrics
            assert len(out.outputs[0].token_ids) == args.output_len
            if i:
                runs.append(
                    {
                        "decode_ms_per_token": (m.last_token_time - m.first_token_time) / (args.output_len - 1) * 1e3,
                        "ttft_ms": (m.first_token_time - m.arrival_time) * 1e3,
                        "output_tokens_per_s": args.output_len / total,
                    }
                )
    median = sorted(runs, key=lambda r: r["decode_ms_per_token"])[len(runs) // 2]
    cost = ModelCost.of(llm.engine.runner.model, llm.engine.model_cfg, llm.engine.runner.kv_dtype)
    name = args.result_name or f"{'cpu-' if device.type == 'cpu' else ''}latency-{model_slug(llm)}-bs1"
    del llm

    metrics = {
        **median,
        "decode_tokens_per_s": 1e3 / median["decode_ms_per_token"],
        "decode_ms_per_token_all": [r["decode_ms_per_token"] for r in runs],
        "prompt_tokens": args.input_len,
        "output_tokens": args.output_len,
        "dtype": str(dtype).removeprefix("torch."),
        "weight_bytes": cost.step_weight_bytes(1),
        "lora_adapter": args.lora_adapter,
    }
    rows = [
        (
            "Heron",
            median["decode_ms_per_token"],
            metrics["decode_tokens_per_s"],
            median["ttft_ms"],
            median["output_tokens_per_s"],
            None,
        )
    ]
    if bandwidth is not None:
        roof_ms = metrics["weight_bytes"] / bandwidth * 1e3
        metrics.update(
            copy_bandwidth_GBps=bandwidth / 1e9,
            roofline_ms_per_token=roof_ms,
            roofline_fraction=roof_ms / median["decode_ms_per_token"],
        )
        rows.append(
            (
                f"roofline ({metrics['weight_bytes'] / 1e9:.2f} GB of weights at {bandwidth / 1e9:,.0f} GB/s)",
                roof_ms,
                1e3 / roof_ms,
                None,
                None,
                metrics["roofline_fraction"],
            )
        )
    if args.hf_baseline:
        from heron.bench.hf_baseline import load_hf_model, run_hf_latency

        hf = load_hf_model(args.model, dtype, device, args.load_format)
        hf_metrics = run_hf_latency(hf, prompts[1], args.output_len, args.temperature, args.num_iters)
        del hf
        metrics.update(hf_metrics, ratio_vs_hf=hf_metrics["hf_decode_ms_per_token"] / median["decode_ms_per_token"])
        rows.append(
            (
                "transformers generate",
                hf_metrics["hf_decode_ms_per_token"],
                1e3 / hf_metrics["hf_decode_ms_per_token"],
                hf_metrics["hf_ttft_ms"],
                hf_metrics["hf_output_tokens_per_s"],
                metrics["ratio_vs_hf"],
            )
        )
    table = format_table(
        rows, ("run", "decode ms/token", "decode tokens/s", "TTFT ms", "output tokens/s", "Heron speed / this")
    )
    header = (
        f"{name}: 1 request, {args.input_len} prompt + {args.output_len} output tokens, {device}, "
        f"{metrics['dtype']}, median of {len(runs)}"
    )
    return finish(name, metrics, device, header + "\n" + table, args.save_result, args.results_dir, monitor)
