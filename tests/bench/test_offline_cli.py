"""`heron bench throughput` and `heron bench latency` end to end, on a tiny random-weight Llama folder (and
transformers on the same folder), with workloads of a few tokens."""

from __future__ import annotations

import argparse
import json

import pytest

from heron.bench import throughput
from heron.bench.report import RESULT_KEYS
from heron.entrypoints.cli import main

TINY_ENGINE = ["--device", "cpu", "--kv-cache-memory-bytes", str(10 << 20)]


def test_bench_subcommands_are_registered(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "throughput" in capsys.readouterr().out
    assert main(["bench"]) == 0  # no benchmark named: the help, not a crash


def test_throughput_with_hf_baseline_saves_the_result(tiny_model_dir, tmp_path, capsys, monkeypatch):
    argv = [
        "bench",
        "throughput",
        "--model",
        tiny_model_dir("llama"),
        *TINY_ENGINE,
        "--num-prompts",
        "4",
        "--input-len-range",
        "5,12",
        "--output-len-range",
        "3,6",
        "--batch-size",
        "4",
        "--hf-baseline",
        "--hf-batch-size",
        "2",
        "--save-result",
        "--result-name",
        "cpu-offline-test",
        "--results-dir",
        str(tmp_path),
    ]
    monkeypatch.setattr("sys.argv", ["/some/bin/heron", *argv])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Heron, max 4 sequences per step" in out and "transformers generate" in out and "physical limit" in out
    result = json.loads((tmp_path / "cpu-offline-test.json").read_text())
    assert tuple(result) == RESULT_KEYS
    assert result["name"] == "cpu-offline-test" and result["gpu"] == "cpu"
    assert result["command"].startswith("heron bench throughput --model ")
    m = result["metrics"]
    # seed 0, 4 prompts: output lengths drawn from [3, 6] after the prompts
    assert m["num_requests"] == 4 and m["output_tokens"] == m["hf_output_tokens"]
    assert m["output_tokens_per_s"] > 0 and m["hf_output_tokens_per_s"] > 0
    assert m["ratio_vs_hf"] == pytest.approx(m["output_tokens_per_s"] / m["hf_output_tokens_per_s"])
    assert m["hf_generated_tokens"] >= m["hf_output_tokens"]  # rows run to their batch's longest output
    assert 0 < m["fraction_of_limit"] and m["limit_bound_by"] in ("memory", "compute")


def test_throughput_dummy_weights_hf_subset_no_limit(tiny_model_dir, tmp_path):
    """--load-format dummy (random weights on both sides, the GPU benchmarks' case)."""
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--model",
            tiny_model_dir("llama"),
            *TINY_ENGINE,
            "--num-prompts",
            "6",
            "--input-len-range",
            "4",
            "--output-len-range",
            "2,3",
            "--batch-size",
            "3",
            "--hf-baseline",
            "--hf-num-prompts",
            "2",
            "--no-limit",
            "--temperature",
            "0",
            "--load-format",
            "dummy",
            "--max-model-len",
            "64",
        ]
    )
    result = throughput.run(args)
    m = result["metrics"]
    assert m["num_requests"] == 6 and m["hf_num_requests"] == 2 and m["hf_batch_size"] == 3
    assert m["prompt_tokens"] == 24 and "fraction_of_limit" not in m
    assert result["name"].startswith("cpu-offline-tiny-llama")
    assert not (tmp_path / f"{result['name']}.json").exists()


def test_latency_saves_the_result(tiny_model_dir, tmp_path, capsys):
    argv = [
        "bench",
        "latency",
        "--model",
        tiny_model_dir("llama"),
        *TINY_ENGINE,
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--num-iters",
        "2",
        "--hf-baseline",
        "--save-result",
        "--result-name",
        "lat",
        "--results-dir",
        str(tmp_path),
        "--gpu-monitor",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "transformers generate" in out and "--gpu-monitor: no NVIDIA GPU" in out  # the run goes on without it
    result = json.loads((tmp_path / "lat.json").read_text())
    assert tuple(result) == RESULT_KEYS
    m = result["metrics"]
    assert m["prompt_tokens"] == 8 and m["output_tokens"] == 5 and len(m["decode_ms_per_token_all"]) == 2
    assert m["decode_ms_per_token"] > 0 and m["decode_tokens_per_s"] == pytest.approx(1e3 / m["decode_ms_per_token"])
    assert m["hf_decode_ms_per_token"] > 0 and m["ratio_vs_hf"] > 0
    assert "roofline_fraction" not in m  # CUDA only


def test_throughput_prefix_workload(tiny_model_dir):
    """--shared-prefix-len: the prefix workload and its name (its limit: test_roofline)."""
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    argv = ["--model", tiny_model_dir("llama"), *TINY_ENGINE, "--num-prompts", "6", "--output-len-range", "2,3"]
    argv += [
        "--shared-prefix-len",
        "20",
        "--num-shared-prefixes",
        "2",
        "--input-len-range",
        "3",
        "--max-model-len",
        "64",
    ]
    result = throughput.run(parser.parse_args([*argv, "--disable-tqdm", "--no-limit"]))
    m = result["metrics"]
    assert result["name"].startswith("cpu-offline-prefix-tiny-llama")
    assert m["prompt_tokens"] == 6 * 23 and m["shared_prefix_len"] == 20 and m["num_shared_prefixes"] == 2
    assert m["cascade_attn"]
