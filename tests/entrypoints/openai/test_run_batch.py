"""`heron run-batch`: a 10,000-line file on a tiny random model, killed (SIGKILL) midway and finished by
--resume with every custom_id exactly once; and each line's response is the body `heron serve` returns for
the same request (the suite's shared server), bad lines and refused fields included."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from heron.engine.async_llm import AsyncLLM
from heron.entrypoints.cli import build_parser
from heron.entrypoints.engine_args import engine_config
from heron.entrypoints.openai.run_batch import resume_output, run_batch
from tests.entrypoints.openai.remote_server import API_KEY, MAX_MODEL_LEN, MODEL


def _line(i: int, url: str = "/v1/completions", **body) -> str:
    # one-token prompts: every prefill is a decode-shaped row, batched in one attention call on the CPU
    body = body or {"prompt": [1 + i % 500], "max_tokens": 1, "temperature": 0}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})


def _results(path) -> dict[str, dict]:
    lines = [json.loads(x) for x in open(path, encoding="utf-8")]
    lines = [x for x in lines if x["custom_id"] is not None]  # (error lines of lines without one)
    by_id = {x["custom_id"]: x for x in lines}
    assert len(by_id) == len(lines), "a custom_id written twice"
    return by_id


def _wait_for_lines(path, count: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or path.read_bytes().count(b"\n") < count:
        assert proc.poll() is None, f"run-batch exited ({proc.returncode}) before {count} results were written"
        assert time.monotonic() < deadline, f"fewer than {count} results after {timeout} s"
        time.sleep(0.05)


def test_ten_thousand_lines_killed_midway_then_resumed(tiny_model_dir, tmp_path):
    n, kill_at = 10_000, 1_000
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(_line(i) + "\n" for i in range(n)))
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "run-batch", "-i", str(src), "-o", str(dst)]
    cmd += ["--model", tiny_model_dir("llama"), "--device", "cpu", "--max-num-seqs", "256", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_lines(dst, kill_at, proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with open(dst, "ab") as f:  # as if killed while writing a line
        f.write(b'{"id": "batch_req_x", "custom_id": "r')
    before = resume_output(str(dst))
    assert kill_at <= len(before) < n
    subprocess.run(cmd + ["--resume"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = _results(dst)
    assert set(got) == {f"r{i}" for i in range(n)}
    assert all(x["response"]["status_code"] == 200 for x in got.values())
    r = got["r7"]["response"]
    assert r["body"]["object"] == "text_completion"
    assert r["body"]["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    assert r["request_id"] == r["body"]["id"]


@pytest.fixture(scope="module")
def engine():
    """The embedded model as the shared server runs it (remote_server.py's flags)."""
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(256 << 20)]
    args = build_parser().parse_args(["run-batch", "-i", "-", "-o", "-", *flags])
    engine = AsyncLLM.from_config(engine_config(args), cpu_threads=1)
    yield engine
    engine.shutdown()


HI = [{"role": "user", "content": "Hi"}]
# (url, body): answers, logprobs, several choices, and the server's 400s and 404 (top_logprobs without logprobs,
# an unknown field, a bad role, an unknown model, a max_tokens that cannot fit, suffix)
BODIES = {
    "chat": (
        "/v1/chat/completions",
        dict(model=MODEL, messages=HI, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2),
    ),
    "chat-n": (
        "/v1/chat/completions",
        dict(messages=HI, n=2, max_completion_tokens=3, temperature=0, stop=["\n"]),
    ),
    "top-logprobs-alone": (
        "/v1/chat/completions",
        {"messages": HI, "max_tokens": 2, "top_logprobs": 2},
    ),
    "unknown-field": ("/v1/chat/completions", {"messages": HI, "frobnicate": 1}),
    "bad-role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}),
    "no-such-model": ("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1}),
    "prompts-n": ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "n": 2, "temperature": 0}),
    "echo-logprobs": (
        "/v1/completions",
        {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1},
    ),
    "too-long": ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}),
    "zero-tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    "suffix": ("/v1/completions", {"prompt": "x", "suffix": "y"}),
}


def _same(got, want, where: str = "body") -> None:
    """Equal up to ids, timestamps and float noise (two engine processes batch the requests differently)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want.keys() - {"id", "created"}:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-3), where
    else:
        assert got == want, where


def test_each_line_answers_what_the_server_answers(engine, server, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "url": u, "body": b}) + "\n" for k, (u, b) in BODIES.items()))
    with open(dst, "w", encoding="utf-8") as out:
        run_batch(engine, str(src), out, set(), progress=False)
    got = _results(dst)
    assert set(got) == set(BODIES)
    statuses = {}
    for key, (url, body) in BODIES.items():
        want = httpx.post(server.url + url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        response = got[key]["response"]
        assert response["status_code"] == want.status_code, key
        _same(response["body"], want.json(), key)
        statuses[key] = want.status_code
        if want.status_code != 200:
            assert got[key]["error"]["message"] == want.json()["error"]["message"], key
    assert statuses["top-logprobs-alone"] == statuses["unknown-field"] == statuses["too-long"] == 400
    assert statuses["chat"] == statuses["prompts-n"] == 200


def test_bad_lines_are_error_lines_and_the_job_goes_on(engine, tmp_path):
    lines = [
        "not json",
        "[1]",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        _line(1, "/v1/embeddings", input="x"),
        _line(2, "/v1/nothing", prompt="x"),
        json.dumps({"custom_id": "r3", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "r4", "url": "/v1/completions", "body": "x"}),
        _line(5, prompt="x", max_tokens=1, stream=True),
        _line(6, prompt="x", max_tokens=1),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with open(dst, "w", encoding="utf-8") as out:
        summary = run_batch(engine, str(src), out, set(), progress=False)
    assert (summary.written, summary.errors) == (9, 8)
    got = _results(dst)
    # r1: /v1/embeddings on a generating engine, the server's 400 naming the runner that serves it
    for cid, param in (("r1", "model"), ("r2", "url"), ("r3", "method"), ("r4", "body"), ("r5", "stream")):
        assert got[cid]["response"]["status_code"] == 400, cid
        assert got[cid]["response"]["body"]["error"]["param"] == param, cid
        assert got[cid]["error"]["message"], cid
    assert got["r6"]["response"]["status_code"] == 200 and got["r6"]["error"] is None
