"""The import rules (ARCHITECTURE.md): entrypoints -> engine -> core, executor,
structured_output, models and kernels; executor -> models -> layers -> kernels; executor ->
sample; layers, sample and executor -> distributed; never the other way. Every part may import
the leaves (LEAVES); config and envs import only the standard library; core/ imports no torch.
And the package's module import graph has no cycle.

Imports are read from the source (ast), at any depth: module-level and inside functions alike
(an import deferred into a function is still an edge of the graph); those under
`if TYPE_CHECKING:` never run and are left out."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "llm_inference"

# Top-level modules that import nothing of the package but envs (which imports the standard
# library only; gc_heap also pause_log), so that every part may import them.
LEAVES = ("config", "envs", "sampling_params", "outputs", "gc_heap", "pause_log")
# part (subpackage or top-level module) -> parts of llm_inference it must never import
FORBIDDEN = {
    "core": {"engine", "executor", "models", "layers", "sample", "kernels", "distributed",
             "entrypoints", "beam_search"},
    "layers": {"core", "engine", "executor", "models", "sample", "entrypoints", "beam_search"},
    "sample": {"core", "engine", "executor", "models", "layers", "entrypoints", "beam_search"},
    "models": {"core", "engine", "executor", "sample", "entrypoints", "beam_search"},
    "distributed": {"core", "engine", "executor", "models", "layers", "sample", "kernels",
                    "entrypoints", "beam_search"},
    "executor": {"engine", "entrypoints", "beam_search"},
    "engine": {"entrypoints", "beam_search"},
    "structured_output": {"core", "engine", "executor", "models", "layers", "sample", "kernels",
                          "distributed", "entrypoints", "beam_search"},
    "beam_search": {"core", "engine", "executor", "models", "layers", "sample", "kernels",
                    "distributed", "entrypoints"},
}  # fmt: skip
# core/ may import only the standard library, itself, and these modules.
CORE_ALLOWED = ("llm_inference.config", "llm_inference.envs", "llm_inference.sampling_params")
# kernels/ may import only the standard library, third-party packages, itself and these.
KERNELS_ALLOWED = ("llm_inference.config", "llm_inference.envs")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(f): f for f in sorted(PKG.rglob("*.py"))}


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module, inside a function) for every import of a file that can run. `from P import
    name` imports the module P.name if there is one, else P; absolute imports only."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    raise AssertionError(f"{path}: use absolute imports")
                for a in child.names:
                    sub = f"{child.module}.{a.name}"
                    found.append((sub if sub in MODULES else child.module, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def imported_modules(path: Path) -> set[str]:
    return {mod for mod, _ in imports(path)}


def part_files(part: str) -> list[Path]:
    """The files of a subpackage or a top-level module (none if it does not exist yet)."""
    folder, module = PKG / part, PKG / f"{part}.py"
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [module] * module.is_file()


def _outside(f: Path, mod: str, allowed: tuple[str, ...]) -> bool:
    own = f.relative_to(PKG).parts[0]
    return not (
        mod.split(".")[0] in sys.stdlib_module_names
        or mod == f"llm_inference.{own}"
        or mod.startswith(f"llm_inference.{own}.")
        or mod in allowed
    )


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_import_direction(part):
    bad = []
    for f in part_files(part):
        for mod in imported_modules(f):
            parts = mod.split(".")
            if parts[0] == "llm_inference" and len(parts) > 1 and parts[1] in FORBIDDEN[part]:
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_only_the_standard_library(leaf):
    bad = []
    for f in part_files(leaf):
        allowed = () if leaf == "envs" else ("llm_inference.envs",)
        if leaf == "gc_heap":  # the pause log; Triton's hooks, where Triton is already imported
            allowed += ("llm_inference.pause_log", "triton")
        bad += [f"{leaf}.py imports {m}" for m in imported_modules(f) if _outside(f, m, allowed)]
    assert not bad, "\n".join(bad)


def test_core_imports_only_stdlib_config_envs_and_sampling_params():
    bad = []
    for f in part_files("core"):
        for mod in imported_modules(f):
            if _outside(f, mod, CORE_ALLOWED):
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_kernels_import_nothing_of_the_package_but_config_and_envs():
    bad = []
    for f in part_files("kernels"):
        for mod in imported_modules(f):
            if mod.startswith("llm_inference") and _outside(f, mod, KERNELS_ALLOWED):
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_core_runs_without_torch_or_numpy():
    code = (
        "import sys, llm_inference.core, llm_inference.core.scheduler; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parents[1] / "src")


def import_graph() -> dict[str, dict[str, bool]]:
    """module -> {module of the package it imports: whether only inside functions}."""
    graph: dict[str, dict[str, bool]] = {}
    for name, path in MODULES.items():
        edges = graph[name] = {}
        for mod, inner in imports(path):
            if mod in MODULES and mod != name:
                edges[mod] = edges.get(mod, True) and inner
    return graph


def find_cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """One cycle (its modules in import order, the first repeated at the end) for each edge
    that closes one in a depth-first walk; [] for an acyclic graph."""
    cycles, state, path = [], {}, []  # state: 1 on the current path, 2 done

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return cycles


def test_find_cycles_reports_each_cycle():
    graph = {"a": {"b": False}, "b": {"c": True}, "c": {"a": False, "d": False}, "d": {}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": False}, "b": {}}) == []


def test_no_import_cycle():
    graph = import_graph()
    assert "llm_inference.config" in graph and len(graph) > 50  # the walk found the package
    shown = []
    for cycle in find_cycles(graph):
        steps = [
            f"{a} -> {b}" + (" (inside a function)" if graph[a][b] else "")
            for a, b in zip(cycle, cycle[1:])
        ]
        shown.append("import cycle:\n  " + "\n  ".join(steps))
    assert not shown, "\n".join(shown)
