"""The orca_jax modules import one another without a cycle, and the package's folders are layers
that import only downwards: the graph of every `import orca_jax...` / `from orca_jax... import
...`, at module level and inside functions alike (a function-level import hides a cycle, it does
not remove it), is acyclic among modules and follows `LAYERS` among folders.

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
    assert "orca_jax.loading.convert" in graph["orca_jax.cli.commands"]  # inside cmd_convert
    assert "orca_jax.models.gpt2" in graph["orca_jax.models"]  # `from orca_jax.models import gpt2`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_among_orca_jax_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The package's layers, top first (docs/architecture.md draws the same tree). A folder imports
# its own modules and those of the layers below it, never above: an entry point may use the
# engine, the engine may not know of HTTP. One row may hold several folders that do not import
# one another. The bottom row is the shared base every layer uses: the configs, the cache
# directories and the error types. The root `orca_jax/__init__.py`, the public API, sits above
# them all and is imported by none.
LAYERS: list[tuple[str, ...]] = [
    ("cli",),  # flags -> an entry point or a benchmark
    ("bench",),  # measures the entry points and the engine
    ("entrypoints",),  # LLM, the OpenAI server, chat templates, tool calls, metrics
    ("engine",),  # requests in, outputs out, one step at a time
    ("spec_decode",),  # proposers and the draft model, beside the engine's step
    ("worker",),  # a step on devices: batch, runner, pipeline, sampling, compiled programs
    ("core",),  # scheduling and memory: scheduler, sequences, KV pages, prefix cache
    ("structured",),  # grammars that constrain sampling
    ("loading",),  # checkpoints, HF and GGUF readers, tokenizers, the model cache
    ("models",),  # Flax modules
    ("distributed",),  # meshes and shardings
    ("config", "cache_dirs", "errors"),  # the shared base
    ("kernels",),  # attention, grouped MLP and quantization math
]
LAYER_OF = {name: depth for depth, row in enumerate(LAYERS) for name in row}


def folder_of(module: str) -> str:
    """The layer node a module belongs to: its first folder under orca_jax, or the top-level
    module itself ("" for the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a layer into one above it (or into the root package), as 'a -> b'."""
    found = []
    for module, deps in sorted(graph.items()):
        here = folder_of(module)
        if here == "":
            continue
        for dep in sorted(deps):
            there = folder_of(dep)
            if there != here and (there == "" or LAYER_OF[there] < LAYER_OF[here]):
                found.append(f"{module} -> {dep}")
    return found


def test_every_folder_and_top_level_module_has_a_layer():
    nodes = {path.stem if path.is_file() else path.name
             for path in PACKAGE_ROOT.iterdir()
             if (path.suffix == ".py" and path.name != "__init__.py") or (path / "__init__.py").exists()}
    assert nodes == set(LAYER_OF), "place a new folder in LAYERS (or fold it into one)"


def test_no_top_level_modules_beyond_the_shared_base():
    """Everything lives in a layer's folder; the top level keeps the public API and two small
    modules that every layer uses (cache_dirs: where the caches live; errors: the types a bad
    request raises at any depth and the server maps to 400)."""
    modules = {path.name for path in PACKAGE_ROOT.glob("*.py")}
    assert modules == {"__init__.py", "cache_dirs.py", "errors.py"}


def test_folders_import_only_downwards():
    upward = upward_imports(import_graph())
    assert upward == [], "imports into a layer above:\n" + "\n".join(upward)


def test_an_upward_import_is_found():
    """The check itself: a core module importing the engine (or the root package) is caught,
    inside a function as much as at the top."""
    graph = import_graph()
    graph["orca_jax.core.scheduler"] = graph["orca_jax.core.scheduler"] | {"orca_jax.engine.engine", "orca_jax"}
    assert upward_imports(graph) == ["orca_jax.core.scheduler -> orca_jax",
                                     "orca_jax.core.scheduler -> orca_jax.engine.engine"]
    assert "orca_jax.engine.engine" in import_graph()["orca_jax.entrypoints.llm"]  # downwards is fine


def test_checkpoints_know_nothing_of_loading():
    """checkpoint.py saves and restores; loading (and converting: load, then save) sit above it."""
    graph = import_graph()
    below_checkpoint = reachable(graph, "orca_jax.loading.checkpoint")
    assert not below_checkpoint & {"orca_jax.loading.loader", "orca_jax.loading.convert", "orca_jax.loading.model_cache"}
    assert {"orca_jax.loading.loader", "orca_jax.loading.checkpoint"} <= graph["orca_jax.loading.convert"]
