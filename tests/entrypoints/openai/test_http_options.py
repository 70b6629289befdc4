"""What vLLM's HTTP flags set, in-process over a stand-in engine (fake_engine.py): CORS (--allowed-origins and
the rest; a browser's preflight is answered before the API-key check), --disable-fastapi-docs, --root-path (the
schema and the pages link through the proxy's prefix) and HTTPS (--ssl-keyfile / --ssl-certfile, on a real
socket)."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import pytest
from fastapi.testclient import TestClient

from heron.entrypoints.openai import api_server
from tests.entrypoints.openai.fake_engine import build_app, output, serve_in_thread
from tests.entrypoints.openai.remote_server import free_port

ORIGIN = "https://ui.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


async def says_hi(engine, request_id: str):
    yield output(request_id, "Hi", finished=True)


def test_any_origin_by_default_and_the_preflight_needs_no_key(monkeypatch):
    app, _ = build_app(monkeypatch, says_hi, "--api-key", "k")
    with TestClient(app) as http:
        pre = http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        refused = http.get("/v1/models", headers={"Origin": ORIGIN})  # the browser can read why
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
        assert refused.json()["error"]["code"] == "invalid_api_key"


def test_allowed_origins_limit_which_pages_may_call(monkeypatch):
    app, _ = build_app(monkeypatch, says_hi, "--allowed-origins", f'["{ORIGIN}"]', "--allow-credentials")
    with TestClient(app) as http:
        ok = http.options("/v1/completions", headers=PREFLIGHT)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = http.options("/v1/completions", headers=dict(PREFLIGHT, Origin="https://elsewhere.example"))
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_a_cors_list_must_be_json(capsys):
    from heron.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "https://a.example"])
    assert "--allowed-origins: not JSON" in capsys.readouterr().err


def test_disable_fastapi_docs_leaves_out_the_schema_and_the_docs(monkeypatch):
    for flags, status in (((), 200), (("--disable-fastapi-docs",), 404)):
        app, _ = build_app(monkeypatch, says_hi, *flags)
        with TestClient(app) as http:
            for path in ("/openapi.json", "/docs", "/swagger-ui/swagger-ui.css"):
                assert http.get(path).status_code == status, (flags, path)
            assert ("href=/docs" in http.get("/").text) == (status == 200)
            assert http.get("/v1/models").status_code == 200


def _serve(app, **kwargs):
    """The app under uvicorn with the server's own settings (`api_server.uvicorn_config`), in a thread."""
    return serve_in_thread(app, config=api_server.uvicorn_config(app, app.state.server.args), **kwargs)


def test_root_path_reaches_the_schema_and_the_pages(monkeypatch):
    app, _ = build_app(monkeypatch, says_hi, "--root-path", "/heron", "--port", str(free_port()))
    with _serve(app) as (url, _):  # the proxy strips the prefix: the paths arrive without it
        assert httpx.get(f"{url}/openapi.json").json()["servers"] == [{"url": "/heron"}]
        assert "/heron/openapi.json" in httpx.get(f"{url}/docs").text
        assert "href=/heron/playground" in httpx.get(f"{url}/").text
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "fake"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return key, cert


def test_https_with_the_ssl_flags(monkeypatch, certificate):
    key, cert = certificate
    port = free_port()
    app, _ = build_app(monkeypatch, says_hi, "--ssl-keyfile", key, "--ssl-certfile", cert, "--port", str(port))
    trusted = ssl.create_default_context(cafile=cert)
    with _serve(app, verify=trusted) as (url, _):
        assert url == f"https://127.0.0.1:{port}"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, verify=trusted)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hi"
        with pytest.raises(httpx.TransportError):  # no plain HTTP on that port
            httpx.get(f"http://127.0.0.1:{port}/health")
