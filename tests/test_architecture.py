"""The house rules of the code base, checked over the source (docs/ARCHITECTURE.md):

- no import circles among our modules (type-checking imports included: a circle drawn only
  for the type checker still ties two modules together), and no module imports from a layer
  above its own;
- the scheduler side (KV accounting, scheduler, core, builder, policies, simulator) loads no torch;
- the live engine imports nothing of the simulator (``sim/``), directly or through others;
- one place builds a Scheduler (the builder), and one sequences a step (EngineCore: every
  driver calls its launch/land; nothing else calls the scheduler's schedule/commit/fail);
- every package folder is installed (pyproject's explicit package list);
- docs/ARCHITECTURE.md's layout names every package folder, and its layers are LAYERS.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# where each top-level folder is installed
FOLDERS = {
    "asyncengine": "asyncengine",
    "policies": "asyncengine.policies",
    "kernels": "asyncengine.kernels",
}

# Lower layers never import higher ones (runtime imports; TYPE_CHECKING blocks do not count).
# Each entry is a folder (a subpackage); a module is in the layer of its deepest listed folder,
# and the package's own top-level modules (cli, compiled, ...) are in the last.
LAYERS: list[tuple[str, ...]] = [
    # plain data (config, sampling params, request, batch plan, outputs), maths, pure helpers
    ("common", "bench", "workloads", "kernels", "speculative"),
    ("policies", "cache", "routing"),  # policies, KV accounting, routing
    ("scheduler",),  # schedule/commit, admission, prefill, retraction, the waiting queue
    ("core",),  # EngineCore (one step's launch/land), the builder, the lifecycle
    # the device side (speculative/draft/ runs a draft model on it), the output side, grammars
    ("executor", "text", "structured", "speculative.draft"),
    ("api", "sim"),  # drivers: the async engine and the simulator
    ("server", ""),  # front ends: the HTTP server, the CLI and the public package
]

# The scheduler side loads no torch: these folders (every module in them) and the output stream.
TORCH_FREE_FOLDERS = ("common", "cache", "policies", "routing", "scheduler", "core", "sim")
TORCH_FREE_MODULES = ("asyncengine.text.stream",)
# runs the real engine beside the simulator, to compare the two
NEEDS_TORCH = ("asyncengine.sim.sim_vs_real",)


def package(folder: str) -> str:
    return "asyncengine" + (f".{folder}" if folder else "")


def module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(tree: ast.AST, type_checking: bool) -> Iterator[tuple[str, list[str]]]:
    """(module, imported names) of every import at any depth; those under ``if TYPE_CHECKING``
    only when ``type_checking``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if not type_checking and _type_checking_block(child):
                stack.extend(getattr(child, "orelse", []))
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, []
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                yield child.module, [alias.name for alias in child.names]
            stack.append(child)


def import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, names in imports(ast.parse(path.read_text(), str(path)), type_checking):
            if target not in modules:
                continue
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            graph[name].update(submodules or [target])
            if len(submodules) < len(names):
                graph[name].add(target)  # names taken from the package itself
            graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for level, folders in enumerate(LAYERS):
        for prefix in map(package, folders):
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = level, len(prefix)
    assert best >= 0, f"{module} is in no layer of tests/test_architecture.py"
    return best


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_nothing_imports_upward() -> None:
    upward = [
        f"{source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
        for source, targets in sorted(import_graph(type_checking=False).items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(source)
    ]
    assert upward == []


def torch_free_modules() -> list[str]:
    folders = tuple(map(package, TORCH_FREE_FOLDERS))
    in_folders = [
        name
        for name in module_files()
        if name.startswith(tuple(f"{folder}." for folder in folders)) or name in folders
    ]
    return sorted(set(in_folders) - set(NEEDS_TORCH)) + list(TORCH_FREE_MODULES)


def test_the_scheduler_side_loads_no_torch() -> None:
    code = f"import sys; import {', '.join(torch_free_modules())}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def imported_closure(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module ``module`` loads, directly or through others (and their packages)."""
    seen: set[str] = set()
    stack = [module]
    while stack:
        name = stack.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
            parent = ".".join(parts[:i])
            if parent in graph and parent not in seen:
                seen.add(parent)
                stack.extend(graph[parent])
    return seen


def test_the_live_engine_imports_no_simulator() -> None:
    graph = import_graph(type_checking=False)
    for live in ("asyncengine.api.engine", "asyncengine.server.app"):
        reached = sorted(
            m for m in imported_closure(live, graph) if m.startswith("asyncengine.sim")
        )
        assert reached == [], f"{live} loads {reached}"
    assert "asyncengine.sim.cost_model" in imported_closure("asyncengine.sim.simulator", graph)


def test_one_place_builds_a_scheduler() -> None:
    sites = []
    for folder in ("asyncengine", "policies", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Scheduler"):
                    sites.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(sites) == 1 and sites[0].startswith("asyncengine/core/builder.py"), sites


def test_one_place_sequences_a_step() -> None:
    sites = []
    for folder in ("asyncengine", "policies", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "asyncengine" / "core" / "engine_core.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                called = ast.unparse(node.func)
                if node.func.attr in ("schedule", "commit") or called.endswith("scheduler.fail"):
                    sites.append(f"{path.relative_to(ROOT)}:{node.lineno} {called}")
    assert sites == [], sites


def test_every_package_folder_is_installed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    present = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert present == listed
    assert config["package-dir"] == {
        "asyncengine.policies": "policies",
        "asyncengine.kernels": "kernels",
    }


def architecture_section(title: str) -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    _, found, rest = text.partition(f"\n## {title}\n")
    assert found, title
    return rest.split("\n## ", 1)[0]


def test_the_layout_names_every_package_folder() -> None:
    """docs/ARCHITECTURE.md's layout has a row for each top folder (``cache/``), which names
    each of its package subfolders (``lora/`` in ``executor/``'s)."""
    rows = {
        line.split("`")[1]: line
        for line in architecture_section("Layout").splitlines()
        if line.startswith("| `")
    }
    missing = []
    for name, path in module_files().items():
        if path.name != "__init__.py":
            continue
        parts = name.split(".")[1:]  # under asyncengine (policies/, kernels/ included)
        top = f"{parts[0]}/" if parts else "asyncengine/"
        if top not in rows or any(f"`{sub}/`" not in rows[top] for sub in parts[1:]):
            missing.append(name)
    assert missing == []


def test_the_layers_are_documented_as_they_are_checked() -> None:
    """The layers paragraph of docs/ARCHITECTURE.md lists LAYERS' folders, group by group."""
    text = architecture_section("Where each concern lives")
    paragraph = text[text.index("Layers, by folder") :].split("The live engine", 1)[0]
    documented = [
        {word.rstrip("/").replace("/", ".") for word in re.findall(r"`([\w/]+/)`", group)}
        for group in paragraph.split("→")
    ]
    assert documented == [set(folders) - {""} for folders in LAYERS]
