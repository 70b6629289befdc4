"""`heron run-batch`: a 10,000-line file on a tiny random model, bad lines as error lines, and --resume after
the job is killed (SIGKILL) midway: every custom_id exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from heron import LLM
from heron.entrypoints.openai.run_batch import resume_output, run_batch


def _line(i: int, url: str = "/v1/completions", **body) -> str:
    # one-token prompts: every prefill is a decode-shaped row, batched in one attention call on the CPU
    body = body or {"prompt": [1 + i % 500], "max_tokens": 2, "temperature": 0}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, device="cpu", max_num_seqs=256, kv_cache_memory=64 << 20)


def _results(path) -> dict[str, dict]:
    lines = [json.loads(x) for x in open(path, encoding="utf-8")]
    lines = [x for x in lines if x["custom_id"] is not None]  # (error lines of lines without one)
    by_id = {x["custom_id"]: x for x in lines}
    assert len(by_id) == len(lines), "a custom_id written twice"
    return by_id


def test_ten_thousand_lines(llm, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(_line(i) + "\n" for i in range(10_000)))
    with open(dst, "w", encoding="utf-8") as out:
        summary = run_batch(llm, str(src), out, set(), progress=False)
    assert (summary.written, summary.errors) == (10_000, 0)
    got = _results(dst)
    assert len(got) == 10_000
    r = got["r7"]["response"]
    assert r["status_code"] == 200 and r["body"]["object"] == "text_completion"
    assert r["body"]["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert r["request_id"] == r["body"]["id"]


def test_bad_lines_are_error_lines_and_chat_matches_llm_chat(llm, tmp_path):
    messages = [{"role": "user", "content": "Hi"}]
    lines = [
        "not json",
        _line(1, "/v1/embeddings", input="x"),
        _line(2, "/v1/nothing", prompt="x"),
        _line(3, prompt="x", max_tokens=0),
        _line(4, prompt="x", max_tokens=10**6),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        _line(5, "/v1/chat/completions", messages=messages, max_tokens=4, temperature=0),
        _line(6, prompt=["a", "b"], max_tokens=2, n=2, temperature=0),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with open(dst, "w", encoding="utf-8") as out:
        summary = run_batch(llm, str(src), out, set(), progress=False)
    assert (summary.written, summary.errors) == (8, 6)
    got = _results(dst)
    for cid, param in (("r1", "url"), ("r2", "url"), ("r3", "max_tokens"), ("r4", "max_tokens")):
        assert got[cid]["response"]["status_code"] == 400, cid
        assert got[cid]["response"]["body"]["error"]["param"] == param, cid
        assert got[cid]["error"]["message"]
    from heron import SamplingParams

    want = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert got["r5"]["response"]["body"]["choices"][0]["message"]["content"] == want
    assert [c["index"] for c in got["r6"]["response"]["body"]["choices"]] == [0, 1, 2, 3]


def test_resume_after_sigkill_writes_each_custom_id_once(model, tmp_path):
    n = 3000
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(_line(i, prompt=[1 + i % 500], max_tokens=4, temperature=0) + "\n" for i in range(n)))
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "run-batch", "-i", str(src), "-o", str(dst)]
    cmd += ["--model", model, "--device", "cpu", "--max-num-seqs", "32", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not dst.exists() or dst.stat().st_size < 20_000):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with open(dst, "ab") as f:  # as if killed while writing a line
        f.write(b'{"id": "batch_req_x", "custom_id": "r')
    before = resume_output(str(dst))
    assert 0 < len(before) < n
    subprocess.run(cmd + ["--resume"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = _results(dst)
    assert set(got) == {f"r{i}" for i in range(n)}
    assert all(x["response"]["status_code"] == 200 for x in got.values())
