"""The package's import graph has no circle and no arrow back up into ``run/``.

Read from the source with ``ast`` (nothing is imported), counting every ``rollverify_jax`` import wherever it is
written: at the top of a module, inside a function (a late import that holds a circle apart is still a circle) and
under ``if TYPE_CHECKING:`` (a type written against an upper layer ties the layers together all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "rollverify_jax"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
# The layers below run/: none of them may import from it (run/ assembles them, never the other way round).
BELOW_RUN = ("scale", "sim", "data", "rollout", "rl", "verify", "models", "tools", "infra")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module of a ``from ... import`` (relative ones resolved against ``module``)."""
    if not node.level:
        return node.module
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, modules: dict[str, Path], root: Path = ROOT) -> set[str]:
    """The package modules ``path`` imports anywhere in its body: ``import a.b``, ``from a import b`` (``a.b``
    when ``b`` is a module, else ``a``), at module level, in functions and under ``if TYPE_CHECKING``."""
    module = module_name(path, root)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, path.name == "__init__.py")
            if base is None:
                continue
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` of a module's attribute: its module
                name = name.rpartition(".")[0]
            if name and name.startswith(PACKAGE + ".") and name != module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imports_of(path, modules, root) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), written as a path that
    starts and ends at the same module, so a failure shows the arrows to cut."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_circle(graph, set(component)) for component in components]


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path inside ``component`` from its first module back to itself."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_cycle_finder_finds_late_and_type_only_imports(tmp_path):
    """The finder itself: a circle closed by a function-level import, one closed under TYPE_CHECKING, and a
    relative import; none of them is missed, and an acyclic graph gives none."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "a.py": "from rollverify_jax import b\n",
        "b.py": "def f():\n    from rollverify_jax.a import x\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollverify_jax.sub.d import Y\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..c import Z\nimport rollverify_jax.sub.e\n",
        "sub/e.py": "import numpy\n",
    }.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["rollverify_jax.sub.d"] == {"rollverify_jax.c", "rollverify_jax.sub.e"}
    assert sorted(find_cycles(graph)) == [["rollverify_jax.a", "rollverify_jax.b", "rollverify_jax.a"],
                                          ["rollverify_jax.c", "rollverify_jax.sub.d", "rollverify_jax.c"]]
    del graph["rollverify_jax.b"]
    graph["rollverify_jax.c"] = set()
    assert find_cycles(graph) == []


def test_the_package_has_no_import_circle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def layer(module: str) -> str:
    """``run`` of ``rollverify_jax.run.builder``; "" for the package itself."""
    return (module.split(".") + [""])[1]


def test_nothing_below_run_imports_run():
    graph = import_graph()
    below = [m for m in graph if layer(m) in BELOW_RUN]
    assert len(below) > 50  # the layers are where this test looks for them
    up = {m: sorted(d for d in graph[m] if layer(d) == "run") for m in below}
    up = {m: deps for m, deps in up.items() if deps}
    assert not up, f"modules below run/ that import run/: {up}"
