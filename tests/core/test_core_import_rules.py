"""core/ is pure Python: no torch, no numpy, nothing of executor/models/layers/kernels/engine."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(importlib.util.find_spec("llm_inference").submodule_search_locations[0])
CORE_MODULES = ["__init__", "request", "block_pool", "kv_cache_manager", "scheduler", "outputs"]
ALLOWED_PACKAGE_IMPORTS = ("llm_inference.config", "llm_inference.sampling_params")

# The top-level package __init__ (LLM, ...) may import torch; stub it with a bare package so
# that only core/ and what core/ itself imports get executed.
PROBE = f"""
import sys, types
pkg = types.ModuleType("llm_inference")
pkg.__path__ = [{str(PACKAGE_DIR)!r}]
sys.modules["llm_inference"] = pkg
import llm_inference.core
{"".join(f"import llm_inference.core.{m}{chr(10)}" for m in CORE_MODULES[1:])}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "triton"))
inner = sorted(m for m in sys.modules if m.startswith("llm_inference.")
               and not m.startswith("llm_inference.core"))
print(repr((heavy, inner)))
"""


def test_importing_core_imports_no_torch_numpy_or_other_layers():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    heavy, inner = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert heavy == []
    assert set(inner) <= set(ALLOWED_PACKAGE_IMPORTS)


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("llm_inference.core" if node.level else node.module)
    return names


def test_core_sources_import_only_stdlib_config_sampling_params_and_core():
    for name in CORE_MODULES:
        for module in imported_modules(PACKAGE_DIR / "core" / f"{name}.py"):
            top = module.split(".")[0]
            ok = (
                top in sys.stdlib_module_names
                or module == "llm_inference.core"
                or module.startswith("llm_inference.core.")
                or module in ALLOWED_PACKAGE_IMPORTS
            )
            assert ok, f"core/{name}.py imports {module}"
