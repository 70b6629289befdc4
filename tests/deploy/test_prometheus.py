"""The monitoring files in deploy/ checked for real: Debian's `prometheus` runs with deploy/prometheus/prometheus.yml
(its target pointed at a live `heron serve`, its interval shortened), scrapes the server while requests run, and
every expression of deploy/grafana/heron-dashboard.json returns data through Prometheus's HTTP API.

`.ci/run` installs the `prometheus` package; where the binary is missing the test is skipped and says so."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.entrypoints.openai.remote_server import RemoteServer, free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRAPE_INTERVAL = "500ms"


def dashboard_expressions() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "heron-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_covers_what_operators_watch():
    exprs = " ".join(e for _, e in dashboard_expressions())
    for metric in (
        "generation_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "num_preemptions_total",
        "prefix_cache_hits_total",
    ):
        assert f"heron:{metric}" in exprs, metric


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus package is not installed (.ci/run installs it)")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = SCRAPE_INTERVAL
    [job] = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{server.port}"]}]
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            _wait(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200, 30, "prometheus ready")
        except TimeoutError as e:
            raise TimeoutError(f"{e}:\n{(work / 'prometheus.log').read_text()[-2000:]}") from None
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout} s")


def _query(url: str, expr: str) -> list[dict]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_every_dashboard_expression_returns_data_from_a_live_server(server, prometheus):
    stop = threading.Event()

    def traffic() -> None:  # requests keep finishing while Prometheus scrapes, so rates and quantiles are real
        with httpx.Client(base_url=server.url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            while not stop.is_set():
                client.post("/v1/completions", json={"model": model, "prompt": "The sky is", "max_tokens": 4})

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        _wait(lambda: _query(prometheus, "up") and _query(prometheus, "up")[0]["value"][1] == "1", 30, "scrape up")
        _wait(lambda: _all_finite(prometheus), 60, "every dashboard expression has a value")
    finally:
        stop.set()
        worker.join()
    for title, expr in dashboard_expressions():
        result = _query(prometheus, expr)
        assert result, f"{title}: {expr} returned no series"
        assert all(math.isfinite(float(r["value"][1])) for r in result), (title, expr, result)


def _all_finite(url: str) -> bool:
    for _, expr in dashboard_expressions():
        result = _query(url, expr)
        if not result or not all(math.isfinite(float(r["value"][1])) for r in result):
            return False
    return True
