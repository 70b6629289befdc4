"""A headless Chromium driven over the DevTools protocol: just enough for the playground test (navigate, run
JavaScript, take a screenshot), with `websockets` instead of selenium and chromedriver."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from websockets.sync.client import connect


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    def __init__(self, binary: str, startup_timeout: float = 20.0) -> None:
        self.stack = contextlib.ExitStack()  # the DevTools connection, once open
        self.profile = tempfile.mkdtemp(prefix="heron-chromium-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # CI runs as root
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "--window-size=1200,800",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its helpers (renderer, GPU, crashpad) in one process group, ended together
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + startup_timeout
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        import httpx

        page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page")
        self.ws = self.stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, proxy=None))
        self.ids = itertools.count(1)

    def send(self, method: str, **params) -> dict:
        """One DevTools command; events that arrive meanwhile are dropped."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 10.0):
        """Poll until the expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.eval(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s: {expression}")
            time.sleep(0.05)
        return value

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        """End Chromium and every helper process of its group, then remove its profile (a helper may still
        be writing there for a moment after the group is signalled)."""
        self.stack.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(self.profile):
            try:
                shutil.rmtree(self.profile)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
