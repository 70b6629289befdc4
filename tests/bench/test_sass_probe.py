"""benchmarks/sass_probe.py: a kernel compiled for sm_90a on the CPU, its registers, spills and loops read. In a
process of its own, and without importing Triton here: the suite's kernel tests run in Triton's interpreter, and
Triton imported before tests/kernels/conftest.py sets TRITON_INTERPRET leaves its own library functions compiled
ones, which the interpreter cannot call."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def test_the_prefill_kernel_compiles_for_sm90_and_its_key_loops_are_found():
    """One program a tile: ptxas holds it to the 128 registers the launch asks for, and the SASS has the two key
    loops (the unmasked tiles', the diagonal's), each with the two matrix products' MMAs and K and V streamed
    as 16-byte asynchronous copies (the launch's alignment, which the probe gives the pointers and strides)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "benchmarks" / "sass_probe.py"), "prefill, 1 share"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=300).stdout
    lines = out.splitlines()
    assert lines[0].startswith("ptxas ") and lines[1].startswith("prefill, 1 share a tile: ")
    assert "Used 128 registers" in lines[1]
    assert int(re.search(r"(\d+) SASS instructions", lines[2]).group(1)) > 1000
    found = [line for line in lines if line.strip().startswith("loop ")]
    assert len(found) == 2 and len(lines) == 5
    for line in found:
        mma, cp = (int(re.search(rf"(\d+) {name}", line).group(1)) for name in ("MMA", r"LDGSTS\.128"))
        assert mma >= 10 and cp > 0, line
