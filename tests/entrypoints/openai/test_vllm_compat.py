"""vLLM's request fields and endpoints users rely on, against a server whose chat template (Qwen3-like)
takes `enable_thinking`, started with `--response-role bot --max-logprobs 25`."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.remote_server import MODEL, RemoteServer, parallel

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
USER = [{"role": "user", "content": "Count from 1 to 9, separated by commas."}]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(
        "--served-model-name", MODEL, "--chat-template", TEMPLATE, "--response-role", "bot", "--max-logprobs", "25"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_chat_template_fields_and_tokenize(server):
    def tokenize(**kw) -> dict:
        r = _post(server, "/tokenize", {"messages": USER, "return_token_strs": True, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    plain = tokenize()
    thinking_off = tokenize(chat_template_kwargs={"enable_thinking": False})
    no_prompt = tokenize(add_generation_prompt=False)
    assert len(plain["token_strs"]) == plain["count"] and "<|im_start|>" in plain["token_strs"]
    assert "<think>" not in plain["token_strs"] and "<think>" in "".join(thinking_off["token_strs"])
    assert thinking_off["tokens"][: plain["count"]] == plain["tokens"]
    assert plain["tokens"][: no_prompt["count"]] == no_prompt["tokens"] and no_prompt["count"] < plain["count"]
    # continue_final_message leaves the assistant's message open: no <|im_end|> after it
    partial = [*USER, {"role": "assistant", "content": "1, 2, 3,"}]
    cont = tokenize(messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert cont["token_strs"][-1] != "<|im_end|>" and cont["tokens"][: no_prompt["count"]] == no_prompt["tokens"]
    both = _post(server, "/tokenize", {"messages": partial, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    reserved = _post(server, "/tokenize", {"messages": USER, "chat_template_kwargs": {"tokenize": True}})
    assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message_with_echo(client):
    partial = [*USER, {"role": "assistant", "content": "1, 2, 3,"}]
    kw = dict(
        model=MODEL,
        messages=partial,
        max_tokens=4,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    plain, echoed, streamed = parallel(
        lambda: client.chat.completions.create(**kw),
        lambda: client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": True}}),
        lambda: list(
            client.chat.completions.create(stream=True, **{**kw, "extra_body": {**kw["extra_body"], "echo": True}})
        ),
    )
    text = plain.choices[0].message.content
    assert text and echoed.choices[0].message.content == "1, 2, 3," + text
    # no generation prompt: the answer continues the last message, and takes its role (not --response-role's)
    assert plain.choices[0].message.role == "assistant" and streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "1, 2, 3," + text


def test_response_role_names_the_answer_after_a_generation_prompt(server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "echo": True}
    plain = _post(server, "/v1/chat/completions", body)
    assert plain.status_code == 200, plain.text
    message = plain.json()["choices"][0]["message"]
    assert message["role"] == "bot" and message["content"]  # echo: the last message is the user's, not the bot's
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert '"role":"bot"' in first and '"content":""' in first


def test_max_logprobs_sets_how_many_a_request_may_ask(server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 25}
    ok = _post(server, "/v1/chat/completions", body)
    assert ok.status_code == 200, ok.text
    assert [len(t["top_logprobs"]) for t in ok.json()["choices"][0]["logprobs"]["content"]] == [25, 25]
    for path, fields, param in (
        ("/v1/chat/completions", {**body, "top_logprobs": 26}, "top_logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 26}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 26}, "prompt_logprobs"),
    ):
        refused = _post(server, path, fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert "max_logprobs (25; --max-logprobs)" in refused.json()["error"]["message"]
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    top = schema["ChatCompletionRequest"]["properties"]["top_logprobs"]["anyOf"][0]
    assert top["maximum"] == 25


def test_prompt_logprobs_match_echoed_logprobs(client):
    out = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=1,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 2},
    )
    choice = out.choices[0]
    plps = choice.model_extra["prompt_logprobs"]
    n_prompt = out.usage.prompt_tokens
    assert len(plps) == n_prompt and plps[0] is None
    in_top = 0
    for j in range(1, n_prompt):
        # the echoed prompt's token logprobs are the same numbers
        tok = next(t for t, lp in plps[j].items() if lp["decoded_token"] == choice.logprobs.tokens[j])
        assert plps[j][tok]["logprob"] == pytest.approx(choice.logprobs.token_logprobs[j], abs=1e-5)
        # every token has its rank, most likely first: the top 2 are 1 and 2, the prompt token's is real
        ranks = [lp["rank"] for lp in plps[j].values()]
        assert 2 <= len(ranks) <= 3 and ranks[:2] == [1, 2] and ranks == sorted(ranks)
        assert (plps[j][tok]["rank"] <= 2) == (len(ranks) == 2)
        in_top += len(ranks) == 2
    assert 0 < in_top < n_prompt - 1  # both cases: a prompt token in the top 2 (its rank was null) and one past it
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_best_of_keeps_the_most_likely_candidates(server, client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=1.0, seed=5)
    best, all3 = parallel(
        lambda: client.completions.create(n=1, best_of=3, **kw),
        lambda: client.completions.create(n=3, logprobs=0, **kw),
    )
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in all3.choices}
    [choice] = best.choices
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text == max(scores, key=scores.get)
    for bad in ({"n": 2, "best_of": 1}, {"best_of": 2, "stream": True}):
        r = _post(server, "/v1/completions", {**kw, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_continuous_usage_stats(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 5 and chunks[-1].choices == []
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_models_by_id_and_ping(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["root"] == "SmolLM2-135M-Instruct"  # the model behind the name
    missing = httpx.get(f"{server.url}/v1/models/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{server.url}/ping", timeout=10).status_code == 200
