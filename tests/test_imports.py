"""The import rules of DESIGN.md: entrypoints -> engine -> core and executor; executor ->
models -> layers -> kernels; never the other way. core/ imports no torch. Any package may
import the top-level envs.py (the A/B switches)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "llm_inference"

# package -> subpackages of llm_inference it must never import
FORBIDDEN = {
    "core": {"engine", "executor", "models", "layers", "kernels", "distributed", "entrypoints"},
    "kernels": {"core", "engine", "executor", "models", "layers", "distributed", "entrypoints"},
    "layers": {"core", "engine", "executor", "models", "entrypoints"},
    "models": {"core", "engine", "executor", "entrypoints"},
    "distributed": {"core", "engine", "executor", "models", "layers", "kernels", "entrypoints"},
    "executor": {"engine", "entrypoints"},
    "engine": {"entrypoints"},
}
# core/ may import only the standard library, itself, and these two modules.
CORE_ALLOWED = ("llm_inference.config", "llm_inference.sampling_params")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: use absolute imports")
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    bad = []
    for f in sorted((PKG / package).rglob("*.py")):
        for mod in imported_modules(f):
            parts = mod.split(".")
            if parts[0] == "llm_inference" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_core_imports_only_stdlib_config_and_sampling_params():
    bad = []
    for f in sorted((PKG / "core").rglob("*.py")):
        for mod in imported_modules(f):
            ok = (
                mod.split(".")[0] in sys.stdlib_module_names
                or mod == "llm_inference.core"
                or mod.startswith("llm_inference.core.")
                or mod in CORE_ALLOWED
            )
            if not ok:
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_core_runs_without_torch_or_numpy():
    code = (
        "import sys, llm_inference.core, llm_inference.core.scheduler; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parents[1] / "src")
