"""The host's share of a decode step, on the CPU: a tiny random Qwen3 (config only) whose forward pass is
replaced by a fixed logits tensor, so what is timed is the engine's own Python (schedule, prepare, sample,
read back, outputs). Qwen3-0.6B's context length (block-table rows of 2,560 blocks). CPU figures are only
indicative of the GPU machine's host (and copies to the device are not made here).

    PYTHONPATH=. python benchmarks/host_profile.py [--batch 1 256] [--steps 200] [--repeats 3] \
        [--temperature 0] [--lines]

--lines prints line_profiler tables of ModelRunner._prepare, SamplingTensors.build and InflightStep.result.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from heron import LLM, SamplingParams
from heron.sampling_params import RequestOutputKind

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    vocab_size=1024,
    rope_theta=1e6,
    tie_word_embeddings=False,
    eos_token_id=1,
    bos_token_id=0,
    torch_dtype="float32",
)


def make_llm(folder: Path, max_num_seqs: int) -> LLM:
    (folder / "config.json").write_text(json.dumps(CONFIG))
    llm = LLM(str(folder), load_format="dummy", device="cpu", max_num_seqs=max_num_seqs, kv_cache_memory=256 << 20)
    runner = llm.engine.runner
    logits = torch.zeros(max_num_seqs, CONFIG["vocab_size"])
    # no model: the rows' logits are fixed (every step samples token 0 greedily)
    runner.run_forward = lambda arrays, graph, meta, rows: logits[: _num_rows(rows)]
    return llm


def _num_rows(rows) -> int:
    return rows if isinstance(rows, int) else len(rows)


def decode_step_us(llm: LLM, batch: int, steps: int, temperature: float) -> float:
    """Median CPU time of LLMEngine.step (this thread's: other processes on a shared machine inflate wall
    time) over `steps` decode steps of `batch` sequences."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(
            f"b{batch}-{i}",
            list(range(2, 18)),
            SamplingParams(
                temperature=temperature, max_tokens=steps + 8, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            ),
        )
    while engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.thread_time()
        engine.step()
        times.append(time.thread_time() - start)
    while engine.has_unfinished():
        engine.step()
    return 1e6 * sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lines", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        llm = make_llm(Path(tmp), max(args.batch))
        if args.lines:
            from line_profiler import LineProfiler

            from heron.executor.inflight import InflightStep
            from heron.executor.sampler import SamplingTensors

            runner = llm.engine.runner
            lp = LineProfiler(
                type(runner)._prepare,
                type(runner).execute,
                SamplingTensors.build.__func__,
                InflightStep.result,
                type(llm.engine).step,
            )
            lp.enable_by_count()
        for batch in args.batch:
            decode_step_us(llm, batch, 20, args.temperature)  # warm
            us = min(decode_step_us(llm, batch, args.steps, args.temperature) for _ in range(args.repeats))
            print(
                f"batch {batch:4d} temperature {args.temperature}: {us:8.1f} us CPU per decode step (host only; "
                f"the least of {args.repeats} medians)"
            )
        if args.lines:
            lp.disable_by_count()
            lp.print_stats(output_unit=1e-6)


if __name__ == "__main__":
    main()
