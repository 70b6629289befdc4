"""Prefill speed (`heron bench latency --prefill`): one batch of --batch-size prompts of --input-len random
tokens, one output token each, in one `LLM.generate` call; the median of --num-iters calls after a warm-up.

Every batch, the warm-up's included, has its own random prompts, so the prefix cache never hits; the run
checks it: the steps must compute every prompt token. The engine splits the batch into steps of at most
--max-num-batched-tokens tokens (its default, 8192 on a GPU, is how users run it); the steps are printed.

mfu = matmul FLOPs / time / matmul rate, the rate of a large square matmul in the engine's dtype measured
in the same run (heron/bench/roofline.py; on a CPU, the CPU's). Matmul FLOPs are 2 per weight per token
that the weight is applied to: 2 x (parameters less the input embedding and the LM head) x prompt tokens
+ 2 x LM-head parameters x prompts, since the engine computes logits only for each prompt's last token
and the input embedding is a row lookup. Attention's FLOPs (4 x heads x head_dim x layers per causal
(query, key) pair) are reported apart and are not in mfu.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

from heron.bench.cli import make_llm, model_slug
from heron.bench.datasets import random_token_requests
from heron.bench.gpu_monitor import maybe_monitor
from heron.bench.report import finish, format_table


@contextlib.contextmanager
def recording_steps(engine) -> Iterator[list[int]]:
    """Yields the list of the tokens of every non-empty step the engine schedules meanwhile."""
    scheduler, steps = engine.scheduler, []
    schedule = scheduler.schedule

    def record():
        batch = schedule()
        if batch.seqs:
            steps.append(batch.total_tokens)
        return batch

    scheduler.schedule = record
    try:
        yield steps
    finally:
        del scheduler.schedule  # the class's method again


def run(args: argparse.Namespace) -> dict:
    import torch

    from heron.bench.roofline import ModelCost, matmul_rate, prefill_flops
    from heron.config import resolve_device, resolve_dtype
    from heron.sampling_params import SamplingParams

    batch, input_len = args.max_num_seqs, args.input_len
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    flop_rate = matmul_rate(device, dtype)  # before the engine holds the device's memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    requests = random_token_requests(
        (args.num_iters + 1) * batch, (input_len, input_len), (1, 1), args.seed, args.max_token_id
    )
    batches = [[r.prompt_token_ids for r in requests[i : i + batch]] for i in range(0, len(requests), batch)]
    llm = make_llm(args)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1)
    tokens = batch * input_len
    runs = []
    monitor = maybe_monitor(args.gpu_monitor)
    with monitor or contextlib.nullcontext():
        for i, prompts in enumerate(batches):  # the first is the warm-up
            with recording_steps(llm.engine) as steps:
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start
            if sum(steps) != tokens or any(len(o.outputs[0].token_ids) != 1 for o in outs):
                raise RuntimeError(
                    f"The engine computed {sum(steps)} prompt tokens in {len(steps)} steps, the batch "
                    f"has {tokens}, each with one output token (prefix-cache hits?)."
                )
            if i:
                runs.append((seconds, steps))
    seconds, steps = sorted(runs)[len(runs) // 2]
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    cost = ModelCost.of(llm.engine.runner.model, llm.engine.model_cfg, llm.engine.runner.kv_dtype)
    name = args.result_name or f"{'cpu-' if device.type == 'cpu' else ''}prefill-{model_slug(llm)}"
    del llm

    matmul, attention = prefill_flops(cost, [input_len] * batch)
    dtype_name = str(dtype).removeprefix("torch.")
    metrics = {
        "prefill_tokens_per_s": tokens / seconds,
        "elapsed_s": seconds,
        "elapsed_s_all": [s for s, _ in runs],
        "mfu": matmul / seconds / flop_rate,
        "batch_size": batch,
        "input_len": input_len,
        "prompt_tokens": tokens,
        "num_steps": len(steps),
        "step_tokens": steps,
        "max_num_batched_tokens": budget,
        "dtype": dtype_name,
        "matmul_flops": matmul,
        "attention_flops": attention,
        "achieved_TFLOPs": matmul / seconds / 1e12,
        "matmul_TFLOPs": flop_rate / 1e12,
    }
    limit_s = matmul / flop_rate
    rows = [
        (f"Heron, {len(steps)} steps", tokens, seconds * 1e3, tokens / seconds, metrics["achieved_TFLOPs"], None),
        (
            f"matmul rate ({dtype_name}, measured)",
            tokens,
            limit_s * 1e3,
            tokens / limit_s,
            metrics["matmul_TFLOPs"],
            metrics["mfu"],
        ),
    ]
    table = format_table(
        rows, ("run", "prompt tokens", "ms", "prefill tokens/s", "matmul TFLOP/s", "Heron speed / this (mfu)")
    )
    header = (
        f"{name}: {batch} prompts of {input_len} tokens, 1 output token each, {device}, {dtype_name}, "
        f"median of {len(runs)}\nsteps (at most {budget:,} tokens each): {' + '.join(f'{n:,}' for n in steps)}"
        f" tokens; attention {attention / 1e12:,.3g} TFLOP besides the matmuls' {matmul / 1e12:,.3g},"
        f" not in mfu"
    )
    return finish(name, metrics, device, header + "\n" + table, args.save_result, args.results_dir, monitor)
