"""Loading the model costs seconds, so the suite shares one server (with API keys); tests that must stop
a server start their own `RemoteServer`."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.remote_server import ALIAS, API_KEY, ENV_API_KEY, MODEL, RemoteServer


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer(
        "--api-key",
        API_KEY,
        "--served-model-name",
        MODEL,
        ALIAS,
        "--metrics-compat",
        "vllm",
        env={"HERON_API_KEY": ENV_API_KEY},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()
