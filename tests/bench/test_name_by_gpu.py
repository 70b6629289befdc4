"""benchmarks/name_by_gpu.py: a device call's H100 records get `-h100`; older files and other GPUs' stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "name_by_gpu.py"


def record(path: Path, gpu: str, mtime: float | None = None) -> None:
    path.write_text(json.dumps({"name": path.stem, "gpu": gpu, "metrics": {}}))
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def test_only_this_calls_h100_records_are_renamed(tmp_path):
    since = tmp_path / "start"
    since.touch()
    start = since.stat().st_mtime
    results = tmp_path / "results"
    results.mkdir()
    record(results / "old-h100-run.json", "NVIDIA H100 80GB HBM3", start - 100)  # before the call: kept
    record(results / "offline.json", "NVIDIA H100 80GB HBM3", start + 1)
    record(results / "latency.json", "NVIDIA H200", start + 1)
    record(results / "done-h100.json", "NVIDIA H100 80GB HBM3", start + 1)
    subprocess.run([sys.executable, str(SCRIPT), str(since), str(results)], check=True, capture_output=True)
    assert sorted(p.name for p in results.iterdir()) == [
        "done-h100.json",
        "latency.json",
        "offline-h100.json",
        "old-h100-run.json",
    ]
    assert json.loads((results / "offline-h100.json").read_text())["name"] == "offline-h100"
