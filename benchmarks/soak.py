"""Soak: a fresh `heron serve` under mixed abusive and normal traffic for a while, then its figures: requests,
outcomes and errors by class, the memory of both processes before and after, KV blocks leaked once idle, and
that a greedy canary request still gives the same text at the end as at the start.

    PYTHONPATH=. python benchmarks/soak.py --duration 600 --out benchmarks/results/cpu-soak-smollm2.json \
        [--workers 8] [-- heron serve flags]

Each worker loops until the deadline over scenarios drawn by weight (SCENARIOS): normal completions and chats
(plain and streamed, n > 1, several prompts), clients that time out or hang up at random moments, and bodies a
hostile or careless client sends (out-of-range and non-finite numbers, booleans as token ids, lone surrogates,
a 10 MB prompt, a body over the size limit, malformed JSON, too many prompts, unknown token ids). Every
answer is classed as expected (ok, refused with 4xx, overloaded 503, client gave up) or not (5xx, another
status, a broken connection, a stream without [DONE], a wrong canary); the run fails on any of the latter. A
worker told the server is overloaded waits as Retry-After asks; the bursts do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"
RETRY_AFTER_S = 1  # what the server's overloaded 503 says
CANARY = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0}
BIG_PROMPT = "word " * 2_000_000  # 10 MB: more characters than any prompt this model can take
OVERSIZED = b"x" * (17 << 20)  # over the default --max-request-body-bytes (16 MiB)
SERVER_FLAGS = ["--max-model-len", "1024", "--max-waiting-requests", "64", "--kv-cache-memory-bytes", str(512 << 20)]


def _chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


# name -> (weight, path, body or raw bytes, expected kind): "ok" | "refused" | "gives up" | "stream" | "hangs up"
SCENARIOS: dict[str, tuple[float, str, object, str]] = {
    "completion": (10, "/v1/completions", {"model": MODEL, "prompt": "The weather today", "max_tokens": 16}, "ok"),
    "completion_stream": (
        10,
        "/v1/completions",
        {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "stream": True},
        "stream",
    ),
    "chat": (8, "/v1/chat/completions", _chat("Name three birds.", max_tokens=16), "ok"),
    "chat_stream": (8, "/v1/chat/completions", _chat("Tell me a joke.", max_tokens=24, stream=True), "stream"),
    "n_samples": (3, "/v1/completions", {"model": MODEL, "prompt": "A poem:", "max_tokens": 12, "n": 4}, "ok"),
    "many_prompts": (
        2,
        "/v1/completions",
        {"model": MODEL, "prompt": [f"Fact {i}:" for i in range(20)], "max_tokens": 8},
        "ok",
    ),
    "tokenize": (3, "/tokenize", {"prompt": "Hello world " * 200}, "ok"),
    "canary": (2, "/v1/completions", CANARY, "ok"),
    "client_timeout": (
        8,
        "/v1/completions",
        {"model": MODEL, "prompt": "Write an essay.", "max_tokens": 200, "ignore_eos": True},
        "gives up",
    ),
    "stream_hang_up": (
        8,
        "/v1/chat/completions",
        _chat("Write a story.", max_tokens=200, ignore_eos=True, stream=True),
        "hangs up",
    ),
    "top_k_overflow": (2, "/v1/completions", {"model": MODEL, "prompt": "Hi", "top_k": 2**63}, "refused"),
    "seed_overflow": (1, "/v1/completions", {"model": MODEL, "prompt": "Hi", "seed": 2**64}, "refused"),
    "nan_temperature": (2, "/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": math.nan}, "refused"),
    "inf_penalty": (1, "/v1/chat/completions", _chat("Hi", presence_penalty=math.inf), "refused"),
    "bool_token_ids": (2, "/v1/completions", {"model": MODEL, "prompt": [True, False, 5]}, "refused"),
    "stream_yes": (1, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": "yes"}, "refused"),
    "lone_surrogate": (2, "/v1/completions", {"model": MODEL, "prompt": ["fine", "a\ud800b"]}, "refused"),
    "surrogate_chat": (1, "/v1/chat/completions", _chat("\udc00"), "refused"),
    "logit_bias_vocab": (
        1,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "logit_bias": {"999999": 5}},
        "refused",
    ),
    "bad_later_prompt": (2, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [10**9]]}, "refused"),
    "too_many_seqs": (1, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 64, "n": 4}, "refused"),
    "huge_prompt": (0.5, "/v1/completions", {"model": MODEL, "prompt": BIG_PROMPT}, "refused"),
    "huge_tokenize": (0.5, "/tokenize", {"prompt": BIG_PROMPT}, "refused"),
    "oversized_body": (0.3, "/v1/completions", OVERSIZED, "refused"),
    "malformed_json": (1, "/v1/chat/completions", b'{"messages": [', "refused"),
    "max_tokens_too_big": (1, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5000}, "refused"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


class Server:
    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--port", str(self.port), *flags]
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the server's own choice
        self.proc = subprocess.Popen(self.cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.engine_pid = int(re.search(r"Engine process started \(pid (\d+)\)", self.log()).group(1))
        self.num_blocks = int(re.search(r"KV cache: (\d+) blocks", self.log()).group(1))

    def log(self) -> str:
        return self.log_path.read_text()

    def rss(self) -> dict[str, float]:
        return {"api_mib": _rss_mib(self.proc.pid), "engine_mib": _rss_mib(self.engine_pid)}

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name, labels other than model_name folded into the name."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=10).text):
            for s in family.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
                if "le" not in s.labels:
                    out[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
        return out


async def _request(http: httpx.AsyncClient, name: str, rng: random.Random, canary: str | None) -> str:
    """One scenario's request; its outcome class."""
    _, path, body, kind = SCENARIOS[name]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN and escapes as such
    headers = {"content-type": "application/json"}
    timeout = httpx.Timeout(300, read=rng.uniform(0.05, 2.0)) if kind == "gives up" else httpx.Timeout(300)
    try:
        if kind in ("stream", "hangs up"):
            hang_up_after = rng.randint(0, 6) if kind == "hangs up" else None
            async with http.stream("POST", path, content=content, headers=headers, timeout=timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _refusal(r, kind)
                events = 0
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    if line == "data: [DONE]":
                        return "ok"
                    if '"error"' in line:
                        return "error event"
                    events += 1
                    if hang_up_after is not None and events > hang_up_after:
                        return "client hung up"
                return "stream without [DONE]"
        r = await http.post(path, content=content, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return "client gave up" if kind == "gives up" else "timeout"
    except httpx.TransportError as e:
        return f"connection error ({type(e).__name__})"
    if r.status_code == 200:
        if name == "canary" and r.json()["choices"][0]["text"] != canary:
            return "wrong canary"
        return "ok" if kind in ("ok", "gives up") else "accepted a bad request"
    return _refusal(r, kind)


def _refusal(r: httpx.Response, kind: str) -> str:
    code = r.json().get("error", {}).get("code") if r.headers.get("content-type") == "application/json" else None
    if r.status_code == 503 and code == "server_overloaded":
        return "overloaded (503)" if "retry-after" in r.headers else "503 without Retry-After"
    if kind == "refused" and r.status_code in (400, 413):
        return f"refused ({r.status_code})"
    return f"server error ({r.status_code} {code})" if r.status_code >= 500 else f"unexpected status ({r.status_code})"


EXPECTED = {"ok", "client gave up", "client hung up", "overloaded (503)", "refused (400)", "refused (413)"}


async def _traffic(server: Server, duration: float, workers: int, canary: str) -> tuple[Counter, Counter]:
    names = list(SCENARIOS)
    weights = [SCENARIOS[n][0] for n in names]
    sent: Counter = Counter()
    outcomes: Counter = Counter()
    deadline = time.monotonic() + duration

    async def worker(i: int) -> None:
        rng = random.Random(i)
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=server.url, limits=limits) as http:
            while time.monotonic() < deadline:
                name = rng.choices(names, weights)[0]
                sent[name] += 1
                outcome = await _request(http, name, rng, canary)
                outcomes[outcome] += 1
                if outcome == "overloaded (503)":
                    await asyncio.sleep(RETRY_AFTER_S)  # as the 503 asks (a burst's requests do not wait)

    async def burst_now_and_then() -> None:
        """Every 30 s, 100 requests at once: more than --max-waiting-requests lets wait."""
        async with httpx.AsyncClient(base_url=server.url, limits=httpx.Limits(max_connections=120)) as http:
            while time.monotonic() + 30 < deadline:
                await asyncio.sleep(30)
                rng = random.Random(int(time.monotonic()))
                results = await asyncio.gather(*(_request(http, "completion", rng, canary) for _ in range(100)))
                sent["burst"] += 100
                outcomes.update(results)

    await asyncio.gather(*(worker(i) for i in range(workers)), burst_now_and_then())
    return sent, outcomes


def _canary(server: Server) -> str:
    return httpx.post(f"{server.url}/v1/completions", json=CANARY, timeout=120).json()["choices"][0]["text"]


def _wait_idle(server: Server, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (
            m["heron:num_requests_running"] == m["heron:num_requests_waiting"] == m["heron:api_requests_waiting"] == 0
        )
        if (idle and m["heron:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--workers", type=int, default=8, help="concurrent clients, besides a burst every 30 s")
    p.add_argument("--out", type=Path, default=None, help="write the summary here (JSON)")
    p.add_argument("--log", type=Path, default=Path("/tmp/heron-soak-server.log"))
    p.add_argument("serve_flags", nargs="*", help=f"heron serve flags (default: {' '.join(SERVER_FLAGS)})")
    args = p.parse_args()
    flags = args.serve_flags or SERVER_FLAGS
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    server = Server(flags, args.log)
    try:
        canary = _canary(server)
        rss_ready = server.rss()
        started = time.monotonic()
        sent, outcomes = asyncio.run(_traffic(server, args.duration, args.workers, canary))
        elapsed = time.monotonic() - started
        m = _wait_idle(server)
        rss_after = server.rss()
        same_canary = _canary(server) == canary
        healthy = httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        unexpected = {k: v for k, v in outcomes.items() if k not in EXPECTED}
        summary = {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit,
            "command": "PYTHONPATH=. python benchmarks/soak.py " + " ".join(sys.argv[1:]),
            "server": " ".join(["heron serve", *flags]),
            "cpu_cores": len(os.sched_getaffinity(0)),
            "duration_s": round(elapsed, 1),
            "requests": sum(sent.values()),
            "requests_by_scenario": dict(sorted(sent.items())),
            "outcomes": dict(sorted(outcomes.items())),
            "unexpected": unexpected,
            "engine_requests_finished": {
                r: m.get(f"heron:request_success_total{{finished_reason={r}}}", 0.0)
                for r in ("stop", "length", "abort")
            },
            "generation_tokens": m.get("heron:generation_tokens_total"),
            "rss_ready_mib": rss_ready,
            "rss_after_mib": rss_after,
            "kv_blocks": server.num_blocks,
            "kv_blocks_leaked": round(m["heron:kv_cache_usage_perc"] * server.num_blocks),
            "waiting_after": {
                k: m[f"heron:{k}"] for k in ("num_requests_running", "num_requests_waiting", "api_requests_waiting")
            },
            "canary_unchanged": same_canary,
            "healthy_after": healthy,
        }
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(120)
    summary["exit_code_after_sigterm"] = code
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    idle = not any(summary["waiting_after"].values())
    ok = not unexpected and summary["kv_blocks_leaked"] == 0 and idle and same_canary and healthy and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
