"""benchmarks/sass_probe.py: a kernel compiled for sm_90a on the CPU, its registers, spills and loops read."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("triton")
SPEC = importlib.util.spec_from_file_location("sass_probe", Path(__file__).parents[2] / "benchmarks" / "sass_probe.py")
sass_probe = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(sass_probe)


def test_the_prefill_kernel_compiles_for_sm90_and_its_key_loops_are_found():
    """One program a tile: ptxas holds it to the 128 registers the launch asks for, and the SASS has the two key
    loops (the unmasked tiles', the diagonal's), each with the two matrix products' MMAs and the K/V loads."""
    what, kernel, constexprs, options = sass_probe.CASES[0]
    assert what == "prefill, 1 share a tile"
    asm = sass_probe.compile_sm90(kernel, constexprs, {"qk_scale", "v_scale"}, num_warps=8, num_stages=3, **options)
    assert "Used 128 registers" in sass_probe.ptxas_usage(asm["ptx"])
    rows, labels = sass_probe.sass(asm["cubin"])
    assert len(rows) > 1000 and sass_probe.count(rows, r"\bHG?MMA") >= 20
    found = sass_probe.loops(rows, labels)
    assert len(found) == 2
    for line in found:
        mma, ldg = (int(re.search(rf"(\d+) {name}", line).group(1)) for name in ("MMA", "LDG"))
        assert mma >= 10 and ldg > 0, line
