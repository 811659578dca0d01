"""The fused sampler's warm-up launches its kernels with every variant (what Triton compiles
for) that requests on every sampling path launch them with, structured outputs included, and
rows filtering by top-p or top-k and top-p: checked on any machine under the Triton interpreter
(sampler_warm_up_checks.py), as the CUDA compile-nothing tests see it on a GPU. It failed while
the warm-up gave the slow path the staged temperatures, a view whose address is not 16-byte
aligned, where the requests' own are, and while it left the filtered search out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("xgrammar")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from interpreter import run_checks  # noqa: E402


def test_sampler_warm_up_covers_the_requests_variants_under_the_interpreter():
    status, log = run_checks(HERE / "sampler_warm_up_checks.py", timeout=600, OMP_NUM_THREADS="1")
    assert status.get("covered") == "ok", log[-8000:]
