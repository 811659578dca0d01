"""The fused sampler's warm-up launches the split race with every variant (what Triton compiles
for) that requests on every sampling path launch it with, structured outputs included: checked
on any machine under the Triton interpreter (sampler_warm_up_checks.py), as the CUDA
compile-nothing test sees it on a GPU. It failed while the warm-up gave the slow path the
staged temperatures, a view whose address is not 16-byte aligned, where the requests' own are."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("xgrammar")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from interpreter import run_checks  # noqa: E402


def test_sampler_warm_up_covers_the_requests_variants():
    status, log = run_checks(HERE / "sampler_warm_up_checks.py", timeout=600, OMP_NUM_THREADS="1")
    assert status.get("covered") == "ok", log[-8000:]
