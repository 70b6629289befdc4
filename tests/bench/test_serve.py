"""`heron bench serve` against a live `heron serve` of the embedded model on a free port of 127.0.0.1.

One sweep (12 requests at 20 req/s, then at inf) is shared by most tests: the server batches each run,
so the suite pays for a few dozen decode steps, not one run per assertion."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from heron.bench import serve
from heron.bench.serve_report import peak_concurrency, summarize

MODEL = "SmolLM2-135M-Instruct"
MODEL_ALIAS = "smol"
API_KEY = "bench-key"
MAX_MODEL_LEN = 1024
ISSUE_FLAGS = [
    "--base-url",
    "--model",
    "--endpoint",
    "--api-key",
    "--dataset-name",
    "--dataset-path",
    "--random-input-len",
    "--random-output-len",
    "--random-range-ratio",
    "--num-prompts",
    "--request-rate",
    "--burstiness",
    "--max-concurrency",
    "--ignore-eos",
    "--seed",
    "--warmup-requests",
    "--percentile-metrics",
    "--metric-percentiles",
    "--goodput",
    "--save-result",
    "--save-detailed",
    "--result-dir",
    "--label",
    "--metadata",
]


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="heron bench serve")
    serve.add_cli_args(parser)
    return serve.main(parser.parse_args([*argv, "--disable-tqdm"]))


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="heron-serve-", suffix=".log", delete=False)
    # One OpenMP thread: the client shares the two cores, and OpenMP threads that wait for a descheduled
    # sibling made decode steps ~10x slower on a busy machine (this module: 2 minutes instead of 25 s).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "heron.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--api-key",
            API_KEY,
            # a name that hides the folder: the client takes the tokenizer of the model the server reports
            "--served-model-name",
            MODEL_ALIAS,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--uvicorn-log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"heron serve exited with {proc.returncode}:\n{open(log.name).read()}")
            if time.monotonic() > deadline:
                pytest.fail(f"heron serve was not healthy after 180 s:\n{open(log.name).read()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def sweep(server, tmp_path_factory):
    """{rate: the saved result} of one sweep, and the folder it wrote."""
    out = tmp_path_factory.mktemp("serve-bench")
    offline = out / "offline.json"  # as `heron bench throughput --save-result` writes it
    offline.write_text(json.dumps({"name": "offline", "metrics": {"output_tokens_per_s": 1000.0}}))
    rc = bench(
        "--base-url",
        server,
        "--api-key",
        API_KEY,
        "--num-prompts",
        "12",
        "--random-input-len",
        "24",
        "--random-output-len",
        "8",
        "--ignore-eos",
        "--request-rate",
        "20,inf",
        "--goodput",
        "ttft:600000",
        "--offline-result",
        str(offline),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out),
        "--label",
        "sweep",
        "--metadata",
        "engine=heron",
        "run=ci",
    )
    assert rc == 0
    return {rate: json.loads((out / f"sweep-rate-{rate}.json").read_text()) for rate in ("20", "inf")}, out


def test_finite_rate_and_inf_complete_without_failures(sweep):
    runs, _ = sweep
    assert runs["20"]["config"]["request_rate"] == 20.0 and runs["inf"]["config"]["request_rate"] == "inf"
    for run in runs.values():
        assert run["metrics"]["completed"] == 12 and run["metrics"]["failed"] == 0 and run["errors"] == {}
        assert [r["index"] for r in run["requests"]] == list(range(12))
        assert all(r["success"] and r["status"] == 200 for r in run["requests"])
    starts = [r["start_s"] for r in runs["20"]["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0.1  # spread by the arrivals; seeded, so always the same draw


def test_result_has_every_field(sweep):
    run = sweep[0]["inf"]
    assert {
        "name",
        "date",
        "gpu",
        "commit",
        "command",
        "metrics",
        "config",
        "metadata",
        "errors",
        "requests",
    } <= run.keys()
    assert run["name"] == "sweep-rate-inf" and run["metadata"] == {"engine": "heron", "run": "ci"}
    m = run["metrics"]
    for key in (
        "completed",
        "failed",
        "duration_s",
        "input_tokens",
        "output_tokens",
        "requests_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "peak_concurrency",
        "goodput_requests_per_s",
    ):
        assert m[key] is not None, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99"):
            assert m[f"{metric}_{stat}_ms"] is not None, f"{metric}_{stat}_ms"
    assert m["ratio_vs_offline"] == pytest.approx(m["output_tokens_per_s"] / 1000.0)
    assert m["goodput_requests_per_s"] == pytest.approx(m["requests_per_s"])  # a 600 s TTFT bound: all meet it
    assert 1 <= m["peak_concurrency"] <= 12
    for r in run["requests"]:
        assert {
            "index",
            "success",
            "status",
            "error",
            "start_s",
            "prompt_len",
            "output_len",
            "output_tokens",
            "output_tokens_source",
            "usage",
            "ttft_ms",
            "tpot_ms",
            "e2el_ms",
            "itl_ms",
        } <= r.keys()


def test_ttft_within_e2el(sweep):
    for run in sweep[0].values():
        for r in run["requests"]:
            assert 0 < r["ttft_ms"] <= r["e2el_ms"]
            assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1), abs=0.01)
            assert len(r["itl_ms"]) <= r["output_tokens"] - 1 and all(g >= 0 for g in r["itl_ms"])


def test_token_counts_equal_the_servers_usage(sweep):
    for run in sweep[0].values():
        for r in run["requests"]:
            assert r["output_tokens_source"] == "usage"
            assert r["output_tokens"] == r["usage"]["completion_tokens"] == r["output_len"] == 8  # --ignore-eos
            assert r["prompt_len"] == r["usage"]["prompt_tokens"]
            assert abs(r["prompt_len"] - 24) <= 2  # the random prompt re-tokenizes to about its drawn length
        assert run["metrics"]["output_tokens"] == sum(r["usage"]["completion_tokens"] for r in run["requests"])
        assert run["metrics"]["input_tokens"] == sum(r["usage"]["prompt_tokens"] for r in run["requests"])


def test_sweep_writes_the_plot_and_the_report(sweep):
    _, out = sweep
    assert (out / "sweep-sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "sweep-sweep.md").read_text()
    assert "![" in report and "(sweep-sweep.png)" in report and "TTFT P99 (ms)" in report
    rows = [line for line in report.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 3 and rows[1].startswith("| 20") and rows[2].startswith("| inf")


def test_a_rejected_request_is_counted_with_its_message(server, tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text(
        "\n".join(
            json.dumps(row)
            for row in [
                {"prompt": "Name a colour.", "output_len": 4},
                {"prompt": "Name a fruit.", "output_len": 2 * MAX_MODEL_LEN},  # cannot fit: the server answers 400
                {"prompt": "Name a tree.", "output_len": 3},
            ]
        )
        + "\n"
    )
    rc = bench(
        "--base-url",
        f"{server}/v1",
        "--api-key",
        API_KEY,
        "--endpoint",
        "/v1/chat/completions",
        "--dataset-name",
        "jsonl",
        "--dataset-path",
        str(workload),
        "--num-prompts",
        "3",
        "--warmup-requests",
        "0",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--label",
        "rejected",
    )
    assert rc == 0
    run = json.loads((tmp_path / "rejected.json").read_text())
    assert run["metrics"]["completed"] == 2 and run["metrics"]["failed"] == 1
    assert "requests" not in run  # per-request detail only with --save-detailed
    [(error, count)] = run["errors"].items()
    assert count == 1 and error.startswith("HTTP 400: ") and "max_tokens" in error
    assert error in capsys.readouterr().out  # the printed report summarises it too


def test_wrong_api_key_fails_every_request_with_the_servers_message(server, tmp_path, capsys, tiny_model_dir):
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt": "Hi", "output_len": 2}) + "\n")
    rc = bench(
        "--base-url",
        server,
        "--model",
        MODEL_ALIAS,
        "--api-key",
        "wrong",
        # /v1/models answers 401 too, so the folder behind the alias is unknown: a tokenizer is named, or
        # the client would look "smol" up on the hub (tens of seconds of retries without a network)
        "--tokenizer",
        tiny_model_dir("llama"),
        "--dataset-name",
        "jsonl",
        "--dataset-path",
        str(workload),
        "--warmup-requests",
        "0",
    )
    assert rc == 1  # nothing completed
    assert "1 x HTTP 401: " in capsys.readouterr().out


def test_help_lists_every_flag_of_the_issue():
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    text = parser.format_help()
    for flag in ISSUE_FLAGS:
        assert flag in text, flag


class _Result:  # the fields of serve.RequestResult that the summary reads
    def __init__(self, start, end, ttft, output_tokens, itl=(), success=True):
        self.start, self.end, self.ttft, self.e2el, self.itl = start, end, ttft, end - start, list(itl)
        self.output_tokens, self.success, self.prompt_len, self.error = output_tokens, success, 10, None
        self.tpot = (self.e2el - ttft) / (output_tokens - 1) if success and output_tokens > 1 else None


def test_summary_arithmetic():
    results = [
        _Result(0.0, 1.0, 0.1, 10, [0.1] * 9),
        _Result(0.5, 2.5, 0.5, 5, [0.5] * 4),
        _Result(3.0, 3.2, 0.2, 1),
        _Result(1.0, 1.5, None, 0, success=False),
    ]
    results[-1].error = "HTTP 503: busy"
    m = summarize(results, duration=4.0, percentiles=[50, 100], slos_ms={"ttft": 300})
    assert (m["completed"], m["failed"], m["output_tokens"], m["input_tokens"]) == (3, 1, 16, 30)
    assert m["requests_per_s"] == 0.75 and m["output_tokens_per_s"] == 4.0
    assert m["tpot_mean_ms"] == pytest.approx((100 + 375) / 2)  # the 1-token request has no TPOT
    assert m["ttft_p100_ms"] == pytest.approx(500) and m["ttft_p50_ms"] == pytest.approx(200)
    assert m["itl_median_ms"] == pytest.approx(100)  # 9 gaps of 0.1 s and 4 of 0.5 s, pooled
    assert m["goodput_requests_per_s"] == 0.5  # ttft <= 300 ms: the first and the third
    assert peak_concurrency(results) == 2  # at 1.0 one request ends as another starts: not three at once


def test_prefix_workload_sends_the_system_prompt(embedded_tokenizer):
    """The shared system prompts are the chat endpoint's system message, and open the prompt on completions."""
    reqs = serve.shared_prefix_text_requests(embedded_tokenizer, 6, 2, 30, (5, 8), (4, 4), seed=0)
    assert len({r.system for r in reqs}) == 2 and all(r.output_len == 4 for r in reqs)
    assert all(r.prompt_len >= 30 + 5 for r in reqs)
    chat = serve.Client(None, "http://x", "/v1/chat/completions", "m", None, True, 0.6, None).payload(reqs[0])
    assert chat["messages"] == [
        {"role": "system", "content": reqs[0].system},
        {"role": "user", "content": reqs[0].prompt},
    ]
    completion = serve.Client(None, "http://x", "/v1/completions", "m", None, True, 0.6, None).payload(reqs[0])
    assert completion["prompt"] == reqs[0].system + reqs[0].prompt
