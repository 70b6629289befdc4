"""The server around the endpoints: auth, errors, metrics, docs, tokenizer routes, disconnects, and many
streams at once."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.remote_server import API_KEY, ENV_API_KEY, MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]


def test_auth(server):
    url = f"{server.url}/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": API_KEY}).status_code == 401  # no Bearer scheme
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
    err = httpx.post(f"{server.url}/v1/completions", content=b"{oops").json()["error"]
    assert err["code"] == "invalid_api_key"  # the key is checked before the body is read
    for key in (API_KEY, ENV_API_KEY):
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for open_path in ("/health", "/metrics", "/version", "/docs", "/openapi.json"):
        assert httpx.get(f"{server.url}{open_path}").status_code == 200, open_path
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()


LONG_PROMPT = "word " * (MAX_MODEL_LEN + 10)

BAD_INPUTS = [
    # (path, body, status, error.param)
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.[0].role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.[0].content",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.[0]"),
    # Each of these once answered 500 or 503, or took the engine down.
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a\ud800b"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a\udc00"]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]}, 400, "messages.[0].content"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "temperature": math.nan}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": math.inf}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": [True, 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [49152]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "bad_words": [" "]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "Hi", "bad_words": ["a"], "allowed_token_ids": [5]}, 400, "bad_words"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "allowed_token_ids": [5], "guided_regex": "a"},
        400,
        "allowed_token_ids",
    ),
    ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, 400, "prompt"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
]


@pytest.mark.parametrize(
    "path,body,status,param", BAD_INPUTS, ids=[f"{p}:{','.join(b) or 'empty'}:{s}" for p, b, s, _ in BAD_INPUTS]
)
def test_bad_input(server, path, body, status, param):
    # json.dumps: ASCII with escapes, as a client writes a lone surrogate (NaN and Infinity as such)
    r = httpx.post(
        f"{server.url}{path}", content=json.dumps(body), headers={**AUTH, "content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}


def test_bad_bodies_and_routes(server):
    url = f"{server.url}/v1/chat/completions"
    r = httpx.post(url, content=b'{"messages": [', headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(url, content=b"", headers={**AUTH, "content-type": "application/json"}).status_code == 400
    assert httpx.get(f"{server.url}/v1/nothing", headers=AUTH).json()["error"]["code"] == "not_found"
    assert httpx.get(url, headers=AUTH).status_code == 405
    # The server still answers after all of that.
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_huge_prompts_are_refused_before_tokenizing(server):
    huge = "word " * 2_000_000  # 10 MB: its tokenization alone once took 15-23 s of the event loop
    bodies = {
        "/v1/completions": {"prompt": huge},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": huge}]},
        "/tokenize": {"prompt": huge},
    }
    for path, body in bodies.items():
        started = time.monotonic()
        r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        assert time.monotonic() - started < 3, path


def test_a_body_over_the_limit_is_413(server):
    url = f"{server.url}/v1/completions"
    declared = httpx.post(url, content=b"x" * (17 << 20), headers=AUTH, timeout=60)
    chunked = httpx.post(url, content=iter([b"x" * (1 << 20)] * 17), headers=AUTH, timeout=60)
    for r in (declared, chunked):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_detokenize_version(server):
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()
    assert detok["prompt"] == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, headers=AUTH).json()
    assert chat["count"] > tok["count"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", httpx.get(f"{server.url}/version").json()["version"])


# vLLM's metrics (vllm/v1/metrics/loggers.py) that Heron exports under heron: (and, with --metrics-compat vllm,
# under vllm:); heron:api_requests_waiting is Heron's own.
EXPECTED_METRICS = {
    "gauge": [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "cache_config_info",
        "api_requests_waiting",
    ],
    "counter": [
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ],
    "histogram": [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
    ],
}
PROCESS_METRICS = ["process_cpu_seconds", "process_resident_memory_bytes", "python_gc_collections", "python_info"]


def test_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=3, temperature=0)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    heron = {n for n in families if n.startswith("heron:")}
    assert heron == {f"heron:{n}" for names in EXPECTED_METRICS.values() for n in names}
    for kind, names in EXPECTED_METRICS.items():
        for name in names:
            ours, theirs = families[f"heron:{name}"], families[f"vllm:{name}"]  # --metrics-compat vllm
            assert ours.type == theirs.type == kind, name
            assert all(s.labels["model_name"] == MODEL for s in ours.samples)
            assert [(s.labels, s.value) for s in ours.samples] == [(s.labels, s.value) for s in theirs.samples]
    assert all(name in families for name in PROCESS_METRICS)
    m = server.metrics()
    assert m["heron:prompt_tokens_total"] > 0 and m["heron:generation_tokens_total"] >= 3
    assert m["heron:request_success_total{finished_reason=length}"] >= 1
    assert m["heron:e2e_request_latency_seconds_count"] >= 1 and m["heron:inter_token_latency_seconds_count"] >= 2
    assert m["heron:prefix_cache_queries_total"] >= m["heron:prefix_cache_hits_total"]
    # Every finished request has an end-to-end latency; the phases only those that ran (one aborted while it
    # waited, by another module's client on this shared server, has none), and prefill/decode those with a token.
    e2e, phase = m["heron:e2e_request_latency_seconds_count"], lambda p: m[f"heron:request_{p}_time_seconds_count"]
    assert 1 <= phase("queue") == phase("inference") <= e2e
    assert 1 <= phase("prefill") <= phase("queue") and 1 <= phase("decode") <= e2e
    assert m["heron:request_generation_tokens_sum"] >= 3 and m["heron:request_params_max_tokens_count"] >= 1
    (info,) = families["heron:cache_config_info"].samples
    assert info.value == 1 and int(info.labels["num_gpu_blocks"]) > 0 and info.labels["block_size"] == "16"


def test_docs_are_served_offline(server):
    html = httpx.get(f"{server.url}/docs").text
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
    assert "http://" not in html and "https://" not in html
    for asset in assets:
        r = httpx.get(f"{server.url}{asset}")
        assert asset.startswith("/") and r.status_code == 200 and len(r.content) > 100, asset
    spec = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/health"):
        assert path in spec["paths"]


def _wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["heron:num_requests_running"] == 0 and m["heron:num_requests_waiting"] == 0
        if (idle and m["heron:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_disconnect_aborts_and_frees_blocks(server, stream):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=httpx.Timeout(60, read=None if stream else 1.5)) as http:
        if stream:
            with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # generating: now hang up
                m = server.metrics()
                assert m["heron:num_requests_running"] == 1 and m["heron:kv_cache_usage_perc"] > 0
        else:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up while the server generates
                http.post(f"{server.url}/v1/completions", json=body, headers=AUTH)
    m = _wait_idle(server)
    assert m["heron:num_requests_running"] == 0 and m["heron:kv_cache_usage_perc"] == 0
    key = "heron:request_success_total{finished_reason=abort}"
    assert m[key] == before[key] + 1
    assert m["heron:generation_tokens_total"] - before["heron:generation_tokens_total"] < 500


def test_50_concurrent_streams_match_solo_runs(server):
    prompts = ["The sky is", "My favourite food is", "Python is a", "In 1990,", "The best way to learn is"]
    kw = dict(model=MODEL, max_tokens=8, temperature=0)

    async def stream(aclient, prompt: str) -> str:
        chunks = await aclient.completions.create(prompt=prompt, stream=True, **kw)
        return "".join([c.choices[0].text async for c in chunks])

    async def run():
        async with server.async_client(timeout=300) as aclient:
            solo = [(await aclient.completions.create(prompt=p, **kw)).choices[0].text for p in prompts]
            many = await asyncio.gather(*(stream(aclient, prompts[i % len(prompts)]) for i in range(50)))
            return solo, many

    solo, many = asyncio.run(run())
    assert many == [solo[i % len(prompts)] for i in range(50)]
    assert _wait_idle(server)["heron:kv_cache_usage_perc"] == 0


def test_logs_say_how_busy_but_never_what(server, client):
    secret = "purple elephants at midnight"
    deadline = time.monotonic() + 20
    # A line reports what its interval saw after the logger's first look at the engine: a request made before
    # that look (this test run alone, on a fresh server) is in no line, so requests go on until one is.
    while "generation throughput" not in server.output() and time.monotonic() < deadline:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": secret}], max_tokens=2)
        time.sleep(0.5)
    log = server.output()
    assert re.search(
        r"prompt throughput: [\d.]+ tokens/s, avg generation throughput: [\d.]+ tokens/s, "
        r"running: \d+, waiting: \d+, KV cache usage: [\d.]+%, prefix cache hit rate: [\d.]+%",
        log,
    )
    assert secret not in log  # prompts are logged only with --enable-log-requests
    assert f"Listening on {server.url} (CTRL+C to quit)" in log  # the socket bound before the model loaded
