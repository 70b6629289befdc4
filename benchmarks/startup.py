"""How long `heron serve` (the embedded model, defaults) takes from its launch to a 200 from /health, on this
machine, with the GGUF conversion cache empty (`cold`: the file's metadata and tokenizer parsed, as every start
did before heron/models/gguf_cache.py, plus writing the entry) and filled (`warm`: every later start). Cold and
warm starts alternate --repeats times in the same run (a shared VM drifts between minutes); each cold start gets
an empty cache folder of its own. Records benchmarks/results/cpu-startup-smollm2.json with --save-result.

    PYTHONPATH=. python benchmarks/startup.py [--repeats 3] [--save-result]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from heron.bench.report import finish


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(cache_dir: str, timeout: float = 300.0) -> float:
    """Seconds from launching `heron serve` with HERON_CACHE_DIR=cache_dir to its first 200 from /health."""
    port = _free_port()
    env = {**os.environ, "HERON_CACHE_DIR": cache_dir}
    cmd = [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while time.perf_counter() - start < timeout:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"heron serve exited with {proc.returncode} before it was ready")
            time.sleep(0.1)
        raise TimeoutError(f"heron serve not ready after {timeout} s")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-result", action="store_true")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as warm_dir:
        time_to_ready(warm_dir)  # fills the warm cache (and the OS's page cache for both kinds of start)
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cold_dir:
                runs["cold"].append(time_to_ready(cold_dir))
            runs["warm"].append(time_to_ready(warm_dir))
    metrics = {"repeats": args.repeats} | {f"{k}_ready_s": statistics.median(v) for k, v in runs.items()}
    metrics |= {f"{k}_ready_s_all": v for k, v in runs.items()}
    table = (
        f"heron serve, embedded model, launch to /health 200 (medians of {args.repeats}): "
        f"cold cache {metrics['cold_ready_s']:.1f} s, warm cache {metrics['warm_ready_s']:.1f} s"
    )
    finish("cpu-startup-smollm2", metrics, "cpu", table, args.save_result)


if __name__ == "__main__":
    main()
