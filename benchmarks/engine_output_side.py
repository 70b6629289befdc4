"""The engine process's output side per step at a large batch, on the CPU: what the served engine pays per
step beyond the model (read-back, LLMEngine._process with detokenization, the step's deltas, pickling), against
the offline path (FINAL_ONLY outputs, text decoded once at the end).

    python benchmarks/shapes.py /tmp/shapes && python benchmarks/engine_output_side.py [/tmp/shapes/qwen3-0.6b]

A tiny random Llama (hidden 64, 2 layers) with the folder's vocabulary and word-level tokenizer, so that
detokenization costs what it does on the GPU benchmark; 256 requests of 50-150 prompt words, 160 greedy
tokens each; steps 20-139 are timed (all 256 decoding). The model's own time is left out.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

from heron.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from heron.engine.engine_core import request_delta
from heron.engine.llm_engine import LLMEngine
from heron.engine.messages import StepOutputs
from heron.executor.inflight import InflightStep
from heron.sampling_params import RequestOutputKind, SamplingParams

NUM_REQUESTS, MAX_TOKENS, TIMED = 256, 160, range(20, 140)


def tiny_model(shape_dir: Path) -> str:
    """A folder with the shape's tokenizer and a tiny Llama config of the same vocabulary."""
    out = Path(tempfile.mkdtemp())
    for f in shape_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out)
    big = json.loads((shape_dir / "config.json").read_text())
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=big["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=big["bos_token_id"],
        eos_token_id=big["eos_token_id"],
    )
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def timed(acc: dict[str, float], key: str, fn):
    def wrapper(*args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            acc[key] += time.perf_counter() - t

    return wrapper


def run(model: str, served: bool) -> dict[str, float]:
    """ms per step of each part: served (DELTA, advance + request_delta + pickle, as engine_core._serve) or offline
    (FINAL_ONLY, step)."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=model, load_format="dummy"),
            cache=CacheConfig(kv_cache_memory=1 << 30),
            scheduler=SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=32768),
        )
    )
    rng = random.Random(0)
    kind = RequestOutputKind.DELTA if served else RequestOutputKind.FINAL_ONLY
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind)
    for i in range(NUM_REQUESTS):
        engine.add_request(
            f"r{i}", " ".join(f"w{rng.randrange(1000, 100000)}" for _ in range(rng.randrange(50, 150))), params
        )
    acc = dict.fromkeys(["read-back", "process", "outputs", "pickle"], 0.0)
    read_back = InflightStep.result
    InflightStep.result = timed(acc, "read-back", read_back)
    engine._process = timed(acc, "process", engine._process)
    op = engine.output_processor
    op.make_output = timed(acc, "outputs", op.make_output)  # the offline path's (none until a request ends)
    try:
        for step in range(TIMED.stop):
            if step == TIMED.start:
                acc.update(dict.fromkeys(acc, 0.0))
            if served:
                reqs = engine.advance()
                t = time.perf_counter()
                deltas = [request_delta(r, op) for r in reqs]
                t2 = time.perf_counter()
                ForkingPickler.dumps(StepOutputs(deltas, engine.get_stats()))
                acc["outputs"] += t2 - t
                acc["pickle"] += time.perf_counter() - t2
            else:
                engine.step()
    finally:
        InflightStep.result = read_back
    acc["process"] -= acc["read-back"]  # _process reads the step back first
    return {k: v / len(TIMED) * 1e3 for k, v in acc.items()}


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_model(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shapes/qwen3-0.6b"))
    for name, served in (("served (DELTA)", True), ("offline (FINAL_ONLY)", False)):
        ms = run(model, served)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
        print(f"{name}: {parts}; output side without read-back {sum(ms.values()) - ms['read-back']:.2f} ms/step")


if __name__ == "__main__":
    main()
