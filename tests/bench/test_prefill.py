"""`heron bench latency --prefill` end to end on a tiny random-weight Llama folder: the steps, the token
counts and the FLOP model in the recorded result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from heron.bench import latency, prefill
from heron.bench.datasets import BenchRequest
from heron.bench.report import RESULT_KEYS
from heron.entrypoints.cli import main

TINY_ENGINE = ["--device", "cpu", "--kv-cache-memory-bytes", str(10 << 20), "--max-model-len", "128"]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    latency.add_cli_args(parser)
    args = parser.parse_args(argv)
    latency.fill_workload_defaults(args)
    return args


def test_prefill_saves_the_result(tiny_model_dir, tmp_path, capsys, monkeypatch):
    model = tiny_model_dir("llama")
    argv = [
        "bench",
        "latency",
        "--prefill",
        "--model",
        model,
        *TINY_ENGINE,
        "--batch-size",
        "3",
        "--input-len",
        "40",
        "--max-num-batched-tokens",
        "64",
        "--num-iters",
        "2",
        "--save-result",
        "--results-dir",
        str(tmp_path),
    ]
    monkeypatch.setattr("sys.argv", ["/some/bin/heron", *argv])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "steps (at most 64 tokens each): 64 + 56 tokens" in out and "Heron, 2 steps" in out
    [path] = tmp_path.glob("cpu-prefill-tiny-llama*.json")  # the default name: [cpu-]prefill-<model>
    result = json.loads(path.read_text())
    assert tuple(result) == RESULT_KEYS and result["gpu"] == "cpu"
    assert result["command"].startswith("heron bench latency --prefill ")
    m = result["metrics"]
    assert m["batch_size"] == 3 and m["input_len"] == 40 and m["prompt_tokens"] == 120
    assert m["step_tokens"] == [64, 56] and m["num_steps"] == 2 and m["max_num_batched_tokens"] == 64
    assert len(m["elapsed_s_all"]) == 2 and m["prefill_tokens_per_s"] == pytest.approx(120 / m["elapsed_s"])
    # the tiny Llama: 2 layers of hidden 64 (4 heads, 2 KV heads, of 16), MLP 128; an untied LM head
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    layers = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    assert m["matmul_flops"] == 2 * layers * 120 + 2 * vocab * 64 * 3  # the LM head once per prompt
    assert m["attention_flops"] == 4 * 2 * 64 * 3 * (40 * 41 // 2)
    assert m["mfu"] == pytest.approx(m["achieved_TFLOPs"] / m["matmul_TFLOPs"]) and m["mfu"] > 0


def test_prefill_refuses_prefix_cache_hits(tiny_model_dir, monkeypatch):
    """Batches that repeat a prompt would be partly served from the cache: the run must notice."""
    same = lambda n, *rest: [BenchRequest(list(range(1, 33)), 1)] * n
    monkeypatch.setattr(prefill, "random_token_requests", same)
    args = _args(
        [
            "--prefill",
            "--model",
            tiny_model_dir("llama"),
            *TINY_ENGINE,
            "--batch-size",
            "2",
            "--input-len",
            "32",
            "--num-iters",
            "1",
        ]
    )
    with pytest.raises(RuntimeError, match="prefix-cache hits"):
        prefill.run(args)


def test_workload_defaults_follow_the_mode():
    args = _args(["--prefill"])
    assert (args.max_num_seqs, args.input_len, args.output_len) == (8, 2048, None)
    args = _args([])
    assert (args.max_num_seqs, args.input_len, args.output_len) == (None, 128, 256)  # None: the engine's, by device
    assert _args(["--batch-size", "4", "--input-len", "16"]).max_num_seqs == 4
    with pytest.raises(ValueError, match="--output-len"):
        _args(["--prefill", "--output-len", "8"])
