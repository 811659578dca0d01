"""The Triton sampling kernel under the CPU interpreter: the checks of sampler_triton_checks.py
run in two child processes started with TRITON_INTERPRET=1 (one per core), so the interpreter
is on before triton is imported there; each check reports its own result here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sampler_triton_checks as checks  # noqa: E402

# The heaviest first, alternating between the two children: ~35 s each on this machine.
HEAVY = ["distribution_combined", "boundaries", "distribution_top_p", "distribution_top_k"]
NAMES = HEAVY + [name for name in checks.CHECKS if name not in HEAVY]


@pytest.fixture(scope="module")
def results() -> tuple[dict[str, str], str]:
    src = str(HERE.parents[1] / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, OMP_NUM_THREADS="1")
    script = str(HERE / "sampler_triton_checks.py")
    children = [
        subprocess.Popen([sys.executable, script, *NAMES[i::2]], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)
    ]  # fmt: skip
    logs = [child.communicate(timeout=600)[0] for child in children]
    log = "\n".join(logs)
    lines = [line.split() for line in log.splitlines() if line.startswith("RESULT ")]
    return {name: status for _, name, status in lines}, log


@pytest.mark.parametrize("name", NAMES)
def test_sampling_kernel_in_interpreter(results, name):
    status, log = results
    assert status.get(name) == "ok", log[-8000:]
