"""Hostile and careless input against one fresh `heron serve`: schemathesis over /openapi.json (schema-valid
and schema-invalid bodies for every operation), and every numeric field of every request body at its type's
edges. Never a 5xx, a schema-valid body is refused only for a rule between fields, and the server stays
healthy and correct after all of it."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.entrypoints.openai.remote_server import MODEL, RemoteServer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64  # short generations: the fuzzer's max_tokens reach the context
MAX_SEQS = 4
EXAMPLES = 20  # per operation and mode

# What a schema-valid body may still be refused for: rules between fields (or between a text and its
# tokens), which JSON Schema cannot state.
CROSS_FIELD = re.compile(
    "|".join(
        [
            r"plus the prompt .* exceeds max_model_len",
            r"The prompt is \d+ tokens long",
            r"min_tokens must be at most max_tokens",
            r"stream_options is only allowed when stream is true",
            r"top_logprobs requires logprobs",
            r"Give either prompt or messages",
            r"sequences: at most \d+ per request",
            # tools: what tool_choice asks of the tools, the server's flags, the history's calls
            r"tool choice requires --enable-auto-tool-choice",
            r"tool_choice needs tools",
            r"tool_choice names the tool",
            r"Two tools have the same name",
            r"The arguments of tool call",
            r"takes no other output constraint",
            r"parameters are not a usable JSON schema",
            # rules of the server's flags and of what Heron keeps (field_policy, serving_*.py)
            r"but the server schedules first come, first served",
            r"store=true is not supported",
            r"best_of \(\d+\) must be at least n",
            r"best_of is not supported with stream",
            r"prompt_logprobs is not available with stream",
            r"continue_final_message and add_generation_prompt cannot both be true",
            r"chat_template_kwargs may not set",
            r"The chat template rejected the messages",
            r"top_logprobs is not supported yet",
            r"a stored prompt template\) is not supported",
            # structured outputs: a schema, regex, grammar or choice list xgrammar cannot compile, or two of them
            r"(guided_\w+|structured_outputs[.\w]*|response_format[.\w]*|text\.format) is invalid",
            r"At most one structured output constraint",
            r"structured_outputs takes exactly one of",
            r"(response_format|text\.format) of type json_schema needs",
            r"is the beam width with use_beam_search",
            r"use_beam_search does not support",
            r"is not supported by run-batch yet",
            r"The model does not support the Embeddings API",  # (this server generates: --runner pooling embeds)
            r"LoRA adapters at runtime is off",  # a 404, as vLLM's routes are absent without the flag
        ]
    )
)


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-seqs-per-request",
        str(MAX_SEQS),
        "--served-model-name",
        MODEL,
        env={"OMP_NUM_THREADS": None},  # the server's own choice of threads
    )
    yield srv
    assert httpx.get(f"{srv.url}/health").status_code == 200
    srv.stop()


def _healthy_and_correct(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    body = {"prompt": "1, 2, 3, 4,", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _cases(operation, mode: schemathesis.GenerationMode) -> list:
    found = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True
    )
    def collect(case):
        found.append(case)

    collect()
    return found


def positive_data_acceptance(ctx, response, case) -> None:
    """A body the schema allows is answered 200, or refused only for a rule between fields."""
    if case.meta.generation.mode.is_positive and response.status_code != 200:
        error = response.json().get("error", {}) if response.status_code in (400, 404) else {}
        assert CROSS_FIELD.search(error.get("message", "")), f"{response.status_code}: {response.text[:500]}"


def test_schemathesis_finds_no_server_error(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.base_url = server.url
    cases = []
    for result in schema.get_all_operations():
        op = result.ok()
        cases += _cases(op, schemathesis.GenerationMode.POSITIVE)
        if op.method.upper() == "POST":  # a GET without parameters has nothing to get wrong
            cases += _cases(op, schemathesis.GenerationMode.NEGATIVE)
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance, negative_data_rejection]

    def call(case) -> tuple[int, str | None]:
        with requests.Session() as session:
            response = case.call(base_url=server.url, session=session, timeout=120)
        try:
            case.validate_response(response, checks=checks, additional_checks=[positive_data_acceptance])
        except (AssertionError, FailureGroup) as e:
            return response.status_code, f"{case.operation.label}: {str(e)[:1500]}"
        return response.status_code, None

    # At once, as many clients would send them: the engine batches the generations.
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, cases))
    failures = [f for _, f in results if f is not None]
    assert not failures, f"{len(failures)} failures, the first ones:\n" + "\n\n".join(failures[:5])
    statuses = [status for status, _ in results]
    # Enough of both kinds reached the server: generations that ran, and bodies refused.
    assert len(cases) > 100 and statuses.count(200) > 40 and statuses.count(400) > 40, sorted(statuses)
    _healthy_and_correct(server)


# -- every numeric field at its type's edges ---------------------------------------------------------------

BASES = {
    "/v1/completions": ("CompletionRequest", {"prompt": [1], "max_tokens": 1}),
    "/v1/chat/completions": (
        "ChatCompletionRequest",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    ),
    "/detokenize": ("DetokenizeRequest", {"tokens": [1]}),
}
TYPE_EDGES = [2**31, 2**63, -(2**63) - 1, 2**64, math.nan, math.inf, -math.inf, True, "1", [1]]


def _numeric_fields(spec: dict) -> list[tuple[str, str, dict]]:
    """(path, field, its numeric schema) for every numeric field of a request body, token lists included."""
    found = []
    for path, (model, _) in BASES.items():
        for field, prop in spec["components"]["schemas"][model]["properties"].items():
            for member in prop.get("anyOf", [prop]):
                if member.get("type") in ("integer", "number"):
                    found.append((path, field, member))
                elif member.get("type") == "array" and member["items"].get("type") == "integer":
                    found.append((path, field, member["items"]))
                elif isinstance(values := member.get("additionalProperties"), dict) and values.get("type") == "number":
                    found.append((path, field, values))  # logit_bias (chat_template_kwargs: any value)
    return found


def _edge_cases(spec: dict) -> tuple[list, list]:
    """Bodies with one numeric field just outside its range or at a type's edge (each must be a 400 naming
    the field), and with one at each end of its range (each must be accepted)."""
    bad, good = [], []
    seen = set()
    for path, field, num in _numeric_fields(spec):
        if (path, field) in seen:
            continue  # a union's second integer list (prompt: ids or lists of ids)
        seen.add((path, field))
        base = BASES[path][1]
        wrap = {
            "prompt": lambda v: [v],
            "stop_token_ids": lambda v: [v],
            "allowed_token_ids": lambda v: [v],
            "tokens": lambda v: [v],
            "logit_bias": lambda v: {"1": v},
        }.get(field, lambda v: v)
        low = num.get("minimum", num.get("exclusiveMinimum"))
        high = num.get("maximum")
        outside = [] if low is None else [low if "exclusiveMinimum" in num else low - 1]
        outside += [] if high is None else [high + 1]
        if num["type"] == "integer":
            outside += [1.5]
        for value in outside + TYPE_EDGES:
            if field == "prompt" and isinstance(value, str | list):
                continue  # ["1"] and [[1]] are prompts
            if value is True or not isinstance(value, int | float) or _outside(value, num):
                bad.append((path, field, {**base, field: wrap(value)}))
        for value in (low, high):
            if value is not None and "exclusiveMinimum" not in num:
                body = {**base, field: wrap(value)}
                if field == "min_tokens":
                    body["max_tokens"] = max(value, 1)
                good.append((path, field, body))
    return bad, good


def _outside(value: float, num: dict) -> bool:
    if math.isnan(value) or math.isinf(value) or (num["type"] == "integer" and value != int(value)):
        return True
    if "minimum" in num and value < num["minimum"]:
        return True
    if "exclusiveMinimum" in num and value <= num["exclusiveMinimum"]:
        return True
    return "maximum" in num and value > num["maximum"]


def test_every_numeric_field_at_its_edges(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    bad, good = _edge_cases(spec)
    assert {f for _, f, _ in bad} >= {"n", "top_k", "seed", "temperature", "logprobs", "priority", "tokens", "prompt"}

    def post(case):
        path, field, body = case
        # json.dumps writes NaN and Infinity as such, as a careless client does
        r = httpx.post(
            f"{server.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"}, timeout=120
        )
        return field, body, r

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(post, bad + good))
    for field, body, r in answers[: len(bad)]:
        assert r.status_code == 400, (field, body, r.text)
        param = r.json()["error"]["param"]
        assert param.split(".")[0] == field, (field, body, r.text)
    for field, body, r in answers[len(bad) :]:
        error = r.json().get("error", {}) if r.status_code != 200 else {}
        assert r.status_code == 200 or CROSS_FIELD.search(error.get("message", "")), (field, body, r.text)
    _healthy_and_correct(server)
