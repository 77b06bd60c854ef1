"""The orca_jax modules import one another without a cycle: the graph of every `import
orca_jax...` / `from orca_jax... import ...`, at module level and inside functions alike (a
function-level import hides a cycle, it does not remove it), is acyclic.

Read from the sources with `ast`, so nothing is imported. A module importing a submodule runs
the parent package's `__init__` first; that edge is not counted (a package importing its own
children is what `orca_jax/__init__.py` and `orca_jax/models/__init__.py` do).
"""

from __future__ import annotations

import ast
from pathlib import Path

import orca_jax

PACKAGE_ROOT = Path(orca_jax.__file__).parent


def _module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    modules = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def known(name: str) -> str | None:
        """`name` if it is a module, else the module that defines it (a.b.c -> a.b)."""
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                found.add(known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else known(base))
    return {name for name in found if name is not None and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = _module_files()
    return {module: _imported_modules(module, path, modules) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state = dict.fromkeys(graph, "new")
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state[dep] == "open":
                return stack[stack.index(dep):] + [dep]
            if state[dep] == "new" and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if state[node] == "new" and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_the_graph_sees_top_level_and_function_level_imports():
    graph = import_graph()
    assert "orca_jax.config" in graph["orca_jax.engine.engine"]  # module level
    assert "orca_jax.loading.convert" in graph["orca_jax.cli"]  # inside cmd_convert
    assert "orca_jax.models.gpt2" in graph["orca_jax.models"]  # `from orca_jax.models import gpt2`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_among_orca_jax_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_checkpoints_know_nothing_of_loading():
    """checkpoint.py saves and restores; loading (and converting: load, then save) sit above it."""
    graph = import_graph()
    below_checkpoint = reachable(graph, "orca_jax.loading.checkpoint")
    assert not below_checkpoint & {"orca_jax.loading.loader", "orca_jax.loading.convert", "orca_jax.loading.model_cache"}
    assert {"orca_jax.loading.loader", "orca_jax.loading.checkpoint"} <= graph["orca_jax.loading.convert"]
