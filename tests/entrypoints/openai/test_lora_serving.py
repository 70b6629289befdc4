"""Multi-LoRA serving on one `heron serve` of the tiny random Llama with random PEFT adapters: the request's `model`
picks the adapter, and the served greedy output of each (in one batch with the base model) equals the offline
LLM's with the same adapter; /v1/models lists them with their parent; adapters are loaded, used, unloaded and
loaded again at runtime; a bad adapter is a 400 and the server serves on; heron:lora_requests_info shows the
adapters. (The adapters themselves against transformers + peft: tests/entrypoints/test_llm_lora.py.)"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from heron import LLM, LoRARequest, SamplingParams
from tests.entrypoints.openai.fake_engine import build_app, serve_in_thread, waits_for_release
from tests.entrypoints.openai.remote_server import API_KEY, RemoteServer, parallel
from tests.entrypoints.test_llm_lora import ALL, make_adapter

BASE = "tiny-llama"
PROMPT = "Hello, my name is"
NEW_TOKENS = 6
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """name -> PEFT folder: three good adapters over the tiny Llama and bad ones (rank 16 > --max-lora-rank 8,
    a Qwen3 adapter of other shapes)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("serve-loras")
    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"))
    return {
        "sql": make_adapter(llama, root / "sql", 1, 8, ALL),
        "chat": make_adapter(llama, root / "chat", 2, 4, ["q_proj", "v_proj", "down_proj"]),
        "late": make_adapter(llama, root / "late", 3, 8, ALL, True),
        "rank16": make_adapter(llama, root / "rank16", 4, 16, ["q_proj"]),
        "qwen3": make_adapter(qwen3, root / "qwen3", 5, 4, ["q_proj"]),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    chat = json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": BASE})
    srv = RemoteServer(
        "--model",
        tiny_model_dir("llama"),
        "--served-model-name",
        BASE,
        "--max-model-len",
        "512",
        "--api-key",
        API_KEY,
        "--metrics-compat",
        "vllm",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"sql={adapters['sql']}",
        chat,
        env={"HERON_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir, adapters) -> dict[str | None, str]:
    """The offline LLM's greedy text per adapter name (None: the base model)."""
    llm = LLM(tiny_model_dir("llama"), kv_cache_memory=16 << 20, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    loras = {name: LoRARequest(name, i, adapters[name]) for i, name in enumerate(["sql", "chat", "late"], 1)}
    outs = llm.generate([PROMPT] * 4, params, use_tqdm=False, lora_request=[*loras.values(), None])
    return {name: o.outputs[0].text for name, o in zip([*loras, None], outs)}


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    return out.choices[0].text


def test_each_adapter_in_one_batch_with_the_base_equals_offline(server, offline):
    client = server.client()
    got = parallel(*[lambda m=m: _complete(client, m) for m in ("sql", "chat", BASE, "sql")])
    assert got == [offline["sql"], offline["chat"], offline[None], offline["sql"]]
    assert len({offline["sql"], offline["chat"], offline[None]}) == 3  # each adapter changes the output
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "chat" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        _complete(client, "nobody")


def test_models_lists_the_adapters_with_their_parent(server, adapters, tiny_model_dir):
    cards = {m.id: m for m in server.client().models.list().data}
    assert list(cards)[:3] == [BASE, "sql", "chat"]
    assert cards[BASE].root == tiny_model_dir("llama") and cards[BASE].parent is None
    for name in ("sql", "chat"):
        assert cards[name].root == adapters[name] and cards[name].parent == BASE
    assert server.client().models.retrieve("sql").parent == BASE


def _post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_load_use_unload_reload_at_runtime(server, adapters, offline):
    client = server.client()
    assert (
        _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]}, {}).status_code
        == 401
    )
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert r.status_code == 200 and "added" in r.text
    assert "late" in {m.id for m in client.models.list().data}
    assert _complete(client, "late") == offline["late"]
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and "removed" in r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    assert (
        _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]}).status_code == 200
    )
    assert _complete(client, "late") == offline["late"]  # three adapters through two slots meanwhile
    assert _complete(client, "sql") == offline["sql"]


@pytest.mark.parametrize(
    ("name", "path", "message"),
    [
        ("missing", "/nowhere", "not found"),
        ("big", "rank16", "more than max_lora_rank"),
        ("other", "qwen3", "the base model needs"),
        ("sql", "late", "has already been loaded"),
        (BASE, "late", "has already been loaded"),
    ],
)
def test_a_bad_adapter_is_a_400_and_the_server_serves_on(server, adapters, offline, name, path, message):
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters.get(path, path)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"
    assert _complete(server.client(), "sql") == offline["sql"]


def test_lora_requests_info_shows_the_running_adapter(server):
    stream = server.client().completions.create(
        model="chat", prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # running now
    metrics = server.metrics()
    stream.close()
    running = [k for k in metrics if k.startswith("heron:lora_requests_info{") and "running_lora_adapters=chat" in k]
    assert running and "max_lora=2" in running[0], sorted(metrics)
    assert any(k.startswith("vllm:lora_requests_info{max_lora=2") for k in metrics)


def test_runtime_updating_is_off_without_the_flag(monkeypatch):
    app, _ = build_app(monkeypatch, waits_for_release)
    with serve_in_thread(app) as (url, _):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def test_a_bad_lora_module_stops_the_server_with_its_reason(monkeypatch, caplog):
    app, exits = build_app(monkeypatch, waits_for_release, "--enable-lora", "--lora-modules", "bad=/nowhere")
    with TestClient(app):
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    assert exits == [1] and "--lora-modules: Failed to load LoRA adapter 'bad'" in caplog.text
