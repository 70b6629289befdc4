"""A real `heron serve` process on a free port of 127.0.0.1, serving the embedded model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

API_KEY = "test-key"
ENV_API_KEY = "env-key"  # a second accepted key, given through HERON_API_KEY
MAX_MODEL_LEN = 1024
MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(
        self, *args: str, env: dict[str, str | None] | None = None, startup_timeout: float = 180.0, until: int = 200
    ) -> None:
        """Start the server and return once /health answers `until` (503: up, the model still loading)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="heron-serve-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "heron.entrypoints.cli",
            "serve",
            "--port",
            str(self.port),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        # One torch thread: on a small shared CPU, two OpenMP threads competing with the test client (and
        # anything else running) make each decode step wait on descheduled threads, seconds at a time.
        # (env: a value of None removes the variable)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        env = {k: v for k, v in env.items() if v is not None}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_health(until, startup_timeout)

    def _wait_health(self, until: int, timeout: float) -> None:
        self.health_seen: list[int] = []  # the distinct /health answers, in order
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"heron serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=2).status_code
                if not self.health_seen or self.health_seen[-1] != status:
                    self.health_seen.append(status)
                if status == until:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"/health did not answer {until} within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def client(self, api_key: str = API_KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kw)

    def async_client(self, api_key: str = API_KEY, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name, labels other than model_name folded into the name."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for s in family.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
                if "le" not in s.labels:
                    out[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
        return self.proc.returncode


def parallel(*calls):
    """Run the calls at once and return their results in order: the engine batches them, so a test pays
    for one request's decode steps instead of the sum."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]
