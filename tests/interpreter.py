"""Run a kernel-check script under the Triton CPU interpreter and collect its results.

The interpreter must be on (TRITON_INTERPRET=1) before triton is imported, so the checks run
in child processes, one per group of arguments, side by side; each check prints a line
`RESULT <name> <status>` (`report_each`, on the child's side)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def run_checks(
    script: Path, arg_groups=((),), timeout: float = 900, **env_extra: str
) -> tuple[dict[str, str], str]:
    """({check name: status}, the children's output) of `script` run once per arg group."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, **env_extra)
    children = [
        subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for args in arg_groups
    ]  # fmt: skip
    log = "\n".join(child.communicate(timeout=timeout)[0] for child in children)
    lines = [line.split() for line in log.splitlines() if line.startswith("RESULT ")]
    return {name: status for _, name, status in lines}, log


def report_each(names, run) -> None:
    """The child's side: `run(name)` for each name, printing `RESULT <name> ok`, or the
    traceback then `RESULT <name> FAIL` (the next name still runs)."""
    for name in names:
        try:
            run(name)
            print(f"RESULT {name} ok", flush=True)
        except Exception:
            traceback.print_exc(file=sys.stdout)
            print(f"RESULT {name} FAIL", flush=True)
