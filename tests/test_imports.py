"""The import rules of DESIGN.md: entrypoints -> engine -> core and executor; executor ->
models -> layers -> kernels; never the other way. core/ imports no torch."""

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
THIRD_PARTY_FORBIDDEN = {"core": {"torch", "numpy", "triton"}}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
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
            if parts[0] in THIRD_PARTY_FORBIDDEN.get(package, ()):
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_core_runs_without_torch():
    code = (
        "import sys, llm_inference.core, llm_inference.core.scheduler; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PKG.parents[1] / "src")
