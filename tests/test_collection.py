"""The whole test tree collects on a fresh venv. Test helpers are imported through the `tests` package
(`from tests.kernels.kernel_utils import ...`), never by a bare module name that an installed package could
shadow: transformers 5.25 installs a top-level `kernels` package, which once hid `tests/kernels`. The check
collects in pytest's importlib mode, which puts no test folder on sys.path, so a bare sibling import fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_whole_tree_collects_without_test_folders_on_sys_path():
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        str(REPO / "tests"),
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "error" not in run.stdout.strip().splitlines()[-1]


def test_tests_is_this_tree():
    import tests

    assert Path(tests.__file__).resolve().parent == REPO / "tests"
