"""What every benchmark command shares: the recorded-result convention and the printed table.

A recorded run is `benchmarks/results/<name>.json` =
  {"name", "date" (UTC, ISO 8601), "gpu" (the CUDA device name, or "cpu"), "commit" (git HEAD, or
   "unknown"), "command" (the command line that produced it), "metrics": {...}}
written by the benchmark command itself (`--save-result`), so that a figure always comes with what made it.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from heron.bench.gpu_monitor import GpuMonitor, format_summary

if TYPE_CHECKING:
    import torch

RESULTS_DIR = "benchmarks/results"
RESULT_KEYS = ("name", "date", "gpu", "commit", "command", "metrics")


def device_name(device: torch.device | str) -> str:
    import torch  # not at the top: `heron --help` imports this module and must not wait for torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def git_commit() -> str:
    """HEAD of the checkout Heron runs from, or $HERON_COMMIT where the tree travelled without its .git
    (the GPU machine), or 'unknown'."""
    if os.environ.get("HERON_COMMIT"):
        return os.environ["HERON_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out or "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it: `heron bench ...` when run through the console script."""
    argv = list(sys.argv if argv is None else argv)
    if argv and os.path.basename(argv[0]) in ("heron", "cli.py"):
        argv[0] = "heron"
    return shlex.join(argv)


def make_result(name: str, metrics: dict, device: torch.device | str, command: str | None = None) -> dict:
    return {
        "name": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": device_name(device),
        "commit": git_commit(),
        "command": command if command is not None else command_line(),
        "metrics": metrics,
    }


def save_result(result: dict, results_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"a benchmark result needs the fields {missing}.")
    path = Path(results_dir) / f"{result['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def format_table(rows: list[tuple], headers: tuple[str, ...]) -> str:
    """A Markdown table (pastes into BENCHMARKS.md as it is); floats get thousands separators."""
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def finish(
    name: str,
    metrics: dict,
    device: torch.device | str,
    table: str,
    save: bool,
    results_dir: str | os.PathLike = RESULTS_DIR,
    monitor: GpuMonitor | None = None,
) -> dict:
    """Print the table, and record the result (with the GPU monitor's record) when asked; returns it."""
    result = make_result(name, metrics, device)
    if monitor is not None:
        result["gpu_monitor"] = monitor.record()
        table += "\n" + format_summary(result["gpu_monitor"])
    print(table)
    if save:
        print(f"saved {save_result(result, results_dir)}")
    return result
