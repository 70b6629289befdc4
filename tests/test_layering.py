"""Imports flow one way: entrypoints, bench -> engine -> executor -> models -> layers / attention -> distributed ->
kernels; the shared top-level modules (configs, sampling params, outputs) may be imported by all and import no
layer package. Read from the source (ast: every import, also inside functions and under TYPE_CHECKING), so a lazy
import does not hide a dependency.

Checked here: the lower packages (models and below) and the shared top-level modules; the packages above them
join RANKS' check as their upward imports go (CHECKED)."""

from __future__ import annotations

import ast
from pathlib import Path

HERON = Path(__file__).resolve().parents[1] / "heron"
RANKS = {
    "entrypoints": 6,
    "bench": 6,
    "engine": 5,
    "executor": 4,
    "models": 3,
    "layers": 2,
    "attention": 2,
    "distributed": 1,
    "kernels": 0,
}
SHARED = {"config", "sampling_params", "outputs", "version"}  # heron/<name>.py
CHECKED = {"models", "layers", "attention", "distributed", "kernels"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(HERON.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The heron modules `path` imports (`from heron.x import y` counts as heron.x.y where that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "heron"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "heron":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


MODULES = {_module_name(p): p for p in HERON.rglob("*.py")}


def _layer(module: str) -> str | None:
    """A module's package under heron/ ('shared' for a shared top-level module, None for the rest)."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in SHARED:
        return "shared"
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else None


def test_every_package_is_ranked():
    packages = {p.name for p in HERON.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(RANKS)


def test_the_lower_layers_and_the_shared_modules_import_only_downward():
    upward = []
    for module, path in MODULES.items():
        layer = _layer(module)
        if layer not in CHECKED | {"shared"}:
            continue
        for target in _imports(path):
            to = _layer(target)
            if to == "shared" or to == layer:
                continue
            if layer == "shared" or to is None or RANKS[to] > RANKS[layer]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_the_lower_layers_have_no_import_cycle():
    graph = {
        m: {t for t in _imports(p) if t in MODULES and _layer(t) in CHECKED | {"shared"}}
        for m, p in MODULES.items()
        if _layer(m) in CHECKED | {"shared"}
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t) :] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
