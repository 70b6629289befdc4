"""The package's layout is a rule, checked here over the source (ast, nothing imported):

- Imports flow one way: entrypoints, bench -> engine -> executor -> models -> layers, attention -> distributed ->
  kernels. A module imports from its own layer or below, never above, lazily inside a function or not.
- The top-level modules (`heron/config.py`, `sampling_params.py`, `outputs.py`, ...) are the shared data types
  every layer may import; they import nothing from a layer package. `heron/__init__.py` is the public face and
  may import anything.
- No import cycle between modules, lazy imports included (a lazy import is no licence for a cycle).
- No module passes 500 lines without saying why in its docstring (a line starting with "Length:").
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "heron"
LAYERS = {
    "kernels": 0,
    "distributed": 1,
    "layers": 2,
    "attention": 2,
    "models": 3,
    "executor": 4,
    "engine": 5,
    "entrypoints": 6,
    "bench": 6,
}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _is_main_block(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """The heron modules `module` imports (for `from heron.x import y`, heron.x.y when that is a module). An
    `if __name__ == "__main__":` block is the module run as a program (`python -m`), not something it depends
    on, and is left out."""
    tree = ast.parse(path.read_text())
    tree.body = [n for n in tree.body if not _is_main_block(n)]
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "heron")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*pkg, base] if base else pkg)
            if base.split(".")[0] == "heron":
                found.update(f"{base}.{a.name}" for a in node.names)
                found.add(base)
    return found


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _layer(module: str) -> int | None:
    """None for the shared top-level modules; the package's __init__ and __main__ (`python -m heron`) rank
    above every layer."""
    parts = module.split(".")
    if module in ("heron", "heron.__main__"):
        return 99
    return LAYERS.get(parts[1]) if len(parts) > 2 or parts[1] in LAYERS else None


def test_imports_flow_one_way():
    mods = _modules()
    upward = []
    for module, path in mods.items():
        mine = _layer(module)
        for target in {_resolve(n, mods) for n in _imports(path, module, top_level_only=False)} - {None, module}:
            theirs = _layer(target)
            if mine is None and theirs is not None:
                upward.append(f"{module} (shared) -> {target}")
            elif mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} -> {target}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    mods = _modules()
    graph = {
        m: {t for n in _imports(p, m, top_level_only=False) if (t := _resolve(n, mods)) not in (None, m)}
        for m, p in mods.items()
    }
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_long_modules_say_why():
    long = []
    for module, path in _modules().items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and not any(line.startswith("Length:") for line in doc.splitlines()):
            long.append(f"{module}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines without a 'Length:' reason in the docstring:\n" + "\n".join(long)
