"""docs/ko/README.md, the Korean quickstart, is executed as written: every ```bash block in order in one shell,
every ```python block at its place through the venv's python, against the embedded model. Only the port is
changed (to a free one), so that the run cannot collide with another server."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import FENCE, REPO

DOC = REPO / "docs" / "ko" / "README.md"


def quickstart_script(text: str, port: int) -> str:
    """The doc's code blocks as one bash script (python blocks as heredocs), with port 8000 replaced."""
    parts = []
    for lang, body in FENCE.findall(text):
        parts.append(body if lang == "bash" else f"python - <<'HERON_PY'\n{body}HERON_PY\n")
    return "\n".join(parts).replace("8000", str(port))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_doc_has_every_step_of_the_path():
    text = DOC.read_text()
    for heading in ("설치", "서버 실행", "OpenAI SDK", "배치 추론", "Continuous batching", "벤치마크", "모니터링"):
        assert re.search(rf"^## \d+\. .*{heading}", text, re.M), heading
    blocks = FENCE.findall(text)
    assert sum(lang == "python" for lang, _ in blocks) >= 2 and sum(lang == "bash" for lang, _ in blocks) >= 6


@pytest.mark.slow
def test_every_command_of_the_korean_quickstart_runs(tmp_path):
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("the quickstart installs into the repo's .venv: run it through `make test`")
    script = tmp_path / "quickstart.sh"
    script.write_text("set -euo pipefail\n" + quickstart_script(DOC.read_text(), _free_port()))
    server_log = REPO / "heron-server.log"  # where the doc's server writes
    try:
        run = subprocess.run(["bash", str(script)], cwd=REPO, capture_output=True, text=True, timeout=600)
        log = server_log.read_text() if server_log.exists() else ""
    finally:
        server_log.unlink(missing_ok=True)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\nserver log:\n{log[-2000:]}"
    out = run.stdout
    assert '"object":"list"' in out.replace(" ", "")  # /v1/models
    assert sum(" -> " in line for line in out.splitlines()) == 3  # the batch job: one line per review
    assert "Serving Benchmark Result" in out and "heron:kv_cache_usage_perc" in out
