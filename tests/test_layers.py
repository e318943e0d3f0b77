"""The package's import graph keeps its layers and has no loops.

Layers, top to bottom: cli (with ray_data beside it) -> jobs (the batch job both run) -> facade
(llm, prompts, progress, tree, the package __init__) -> engine -> model -> kernels. memory/
(reporting) is imported only by the facade, jobs, ray_data and the CLI. Leaf utilities
(validation, and the settings package: the table every layer reads its settings from) may be
imported from anywhere and import only leaves. Every import counts, including those inside functions,
since a lazy import is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"pagedgen": ROOT / "pagedgen", "pagedgen.kernels": ROOT / "kernels"}

ENTRY_POINTS = {"pagedgen.__main__"}  # `python -m pagedgen` runs the CLI
FACADE = {"pagedgen", "pagedgen.llm", "pagedgen.prompts", "pagedgen.progress", "pagedgen.tree"}
LEAVES = {"pagedgen.validation"}
LEAF_PACKAGES = ("pagedgen.settings",)
# Which layers each layer may import (besides itself and the leaves).
ALLOWED = {
    "cli": {"jobs", "facade", "engine", "model", "kernels", "memory", "ray_data"},
    # The Ray Data stage runs the job's line rules and the facade inside each replica.
    "ray_data": {"jobs", "facade", "engine", "model", "kernels", "memory"},
    "jobs": {"facade", "engine", "model", "kernels", "memory"},
    "facade": {"engine", "model", "kernels", "memory"},
    "memory": {"engine"},
    "engine": {"model", "kernels"},
    "model": {"kernels"},
    "kernels": set(),
}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def layer_of(module: str) -> str:
    if module in ENTRY_POINTS:
        return "cli"
    if module in FACADE:
        return "facade"
    if module in LEAVES or any(module == p or module.startswith(p + ".") for p in LEAF_PACKAGES):
        return "leaf"
    return module.split(".")[1]


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """Every pagedgen module `module` imports, wherever the import statement sits."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(module, is_package, node.module, node.level)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known and name != module}


def resolve_from(module: str, is_package: bool, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {module: imported_modules(module, path, known) for module, path in files.items()}


def is_ancestor_package(candidate: str, module: str) -> bool:
    """Importing a.b.c runs a/__init__ and a/b/__init__: those edges are not the module's own."""
    return module.startswith(candidate + ".")


def test_every_import_respects_the_layer_rule():
    wrong = []
    for module, targets in import_graph().items():
        source = layer_of(module)
        for target in sorted(targets):
            destination = layer_of(target)
            if destination in ("leaf", source) or is_ancestor_package(target, module):
                continue
            if source == "leaf" or destination not in ALLOWED[source]:
                wrong.append(f"{module} ({source}) imports {target} ({destination})")
    assert not wrong, "imports against the layer rule:\n" + "\n".join(wrong)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def without_package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package __init__ that re-exports its children is not a loop with them."""
    return {
        module: {t for t in targets if not is_ancestor_package(t, module) and not is_ancestor_package(module, t)}
        for module, targets in graph.items()
    }


def test_no_import_cycles():
    cycle = find_cycle(without_package_edges(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_a_cycle_and_a_wrong_layer():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert layer_of("pagedgen.memory.tracker") == "memory"
    assert "memory" not in ALLOWED["engine"]
    assert "cli" not in ALLOWED["ray_data"] and "cli" not in ALLOWED["jobs"]


C_FLAG_SETS = [("portable", [])]
if platform.machine() in ("x86_64", "AMD64"):
    C_FLAG_SETS.append(("sapphirerapids", ["-march=sapphirerapids", "-fopenmp"]))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("flags", [f for _, f in C_FLAG_SETS], ids=[n for n, _ in C_FLAG_SETS])
@pytest.mark.parametrize("header", sorted(p.name for p in (ROOT / "kernels" / "cpu").glob("*.h")))
def test_each_c_header_compiles_alone(header, flags, tmp_path):
    """A header that needs another file's types or includes first is a hidden include loop.
    The x86 flag set turns on the feature-guarded parts (AVX-512, AMX) whatever this CPU has."""
    source = tmp_path / "only_header.c"
    source.write_text(f'#include "{header}"\n')
    result = subprocess.run(
        ["gcc", "-fsyntax-only", "-Wall", "-Werror", *flags, "-I", str(ROOT / "kernels" / "cpu"), str(source)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
