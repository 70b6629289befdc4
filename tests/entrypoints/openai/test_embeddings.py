"""POST /v1/embeddings on `heron serve --runner pooling` (a tiny random Qwen3, LAST pooling, chunked prefill)
through the openai SDK, float and base64, against transformers; bad inputs and the wrong runner are 400s."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

from tests.entrypoints.openai.remote_server import API_KEY, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "tiny-embed"
TEXTS = ["Hello world.", "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def pooling_server(folder):
    srv = RemoteServer(
        folder,
        "--runner",
        "pooling",
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "16",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(folder):
    """transformers' last hidden state of each text's last token, normalised."""
    from transformers import AutoModel, AutoTokenizer

    model, tok = AutoModel.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=0).numpy()

    return embed, tok


def post(server, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def test_sdk_float_and_base64_match_transformers(pooling_server, expected):
    embed, tok = expected
    client = pooling_server.client()
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float", user="u1")
    ids = [tok.encode(t) for t in TEXTS]
    assert floats.model == MODEL and [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(floats.data, ids):
        np.testing.assert_allclose(d.embedding, embed(i), atol=2e-5)
    # the SDK's default asks for base64 and decodes it; the raw body holds little-endian float32
    default = client.embeddings.create(model=MODEL, input=TEXTS[1])
    np.testing.assert_allclose(default.data[0].embedding, floats.data[1].embedding, atol=2e-5)
    raw = post(pooling_server, {"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats.data[0].embedding, atol=2e-5)


def test_token_inputs_and_truncation(pooling_server, expected):
    embed, tok = expected
    ids = tok.encode(TEXTS[1])
    one = post(pooling_server, {"input": ids}).json()
    many = post(pooling_server, {"input": [ids[:4], ids]}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], embed(ids), atol=2e-5)
    np.testing.assert_allclose(many["data"][0]["embedding"], embed(ids[:4]), atol=2e-5)
    long = ids * 20  # past max_model_len (128)
    cut = post(pooling_server, {"input": long, "truncate_prompt_tokens": 6}).json()
    assert cut["usage"]["prompt_tokens"] == 6
    np.testing.assert_allclose(cut["data"][0]["embedding"], embed(long[-6:]), atol=2e-5)
    raw = post(pooling_server, {"input": TEXTS[1], "normalize": False}).json()["data"][0]["embedding"]
    assert np.linalg.norm(raw) > 1.5  # (hidden states after the final RMSNorm: norm about sqrt(64))


def test_bad_inputs_are_400s(pooling_server, folder):
    cases = [
        ({"input": "hi", "dimensions": 8}, "dimensions", "not supported by this model"),
        ({"input": [1] * 200}, "input", "maximum context length (max_model_len) is 128"),
        ({"input": "hi", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens", "at most max_model_len"),
        ({"input": []}, "input", ""),
        ({"input": [[1, 2], [10**9]]}, "input", "prompt token ids must be in"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype", "embeddings are float32"),
        ({"input": "hi", "priority": 1}, "priority", "--scheduling-policy priority"),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ]
    for body, param, words in cases:
        r = post(pooling_server, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
        assert words in r.json()["error"]["message"], r.text
    # generation endpoints on a pooling server: a 400 that says which runner serves them
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi"})]:
        r = post(pooling_server, body, path)
        assert r.status_code == 400 and "runs it for embeddings (--runner pooling)" in r.json()["error"]["message"]
    assert post(pooling_server, {"input": "still fine"}).status_code == 200


def test_embeddings_on_a_generation_server_is_a_400(server):
    r = post(server, {"input": "hi"})
    assert r.status_code == 400, r.text
    assert "does not support the Embeddings API" in r.json()["error"]["message"]
    assert "--runner pooling" in r.json()["error"]["message"]


def test_run_batch_embeddings_answer_as_the_server(pooling_server, folder, expected, tmp_path):
    """`heron run-batch --runner pooling`: /v1/embeddings lines answered as the pooling server answers them
    (equal to transformers), a generation line the server's 400 naming the runner."""
    embed, tok = expected
    bodies = {
        "one": ("/v1/embeddings", {"model": MODEL, "input": TEXTS[0]}),
        "two": ("/v1/embeddings", {"model": MODEL, "input": TEXTS, "encoding_format": "float"}),
        "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    }
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "url": u, "body": b}) + "\n" for k, (u, b) in bodies.items()))
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "run-batch", "-i", str(src), "-o", str(dst), "--no-progress"]
    cmd += ["--model", folder, "--served-model-name", MODEL, "--runner", "pooling", "--max-model-len", "128"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    for key, (url, body) in bodies.items():
        want = post(pooling_server, body, url)
        response = got[key]["response"]
        assert response["status_code"] == want.status_code, key
        if want.status_code != 200:
            assert response["body"]["error"] == want.json()["error"], key
            continue
        assert response["request_id"] == response["body"]["id"] and response["body"]["usage"] == want.json()["usage"]
        for mine, theirs in zip(response["body"]["data"], want.json()["data"]):
            np.testing.assert_allclose(mine["embedding"], theirs["embedding"], atol=2e-5)
    np.testing.assert_allclose(
        got["two"]["response"]["body"]["data"][1]["embedding"], embed(tok.encode(TEXTS[1])), atol=2e-5
    )
    assert got["chat"]["response"]["status_code"] == 400 and got["chat"]["error"]["message"]
