"""benchmarks/attention_loop_variants.py and attention_tma.py under the CPU interpreter: each
edited copy of the tiled kernel, and the TMA kernel, against the reference. The loop variants
are string edits of kernels/unified_attention.py; when the kernel changes so that an edit no
longer applies, the script raises and this test says so. The names say "interpreter": the GPU
machine's Triton interpreter fails them, and scripts/gpu_check.sh runs -k "not interpreter"."""

from __future__ import annotations

from pathlib import Path

import pytest
from interpreter import run_checks

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_loop_variants_match_the_reference_in_the_interpreter():
    results, log = run_checks(BENCHMARKS / "attention_loop_variants.py", [("--check",)], 300)
    # the shipped kernel and its 6 edited copies, 3 cases each
    assert len(results) == 21 and set(results.values()) == {"ok"}, log[-4000:]


def test_tma_kernel_matches_the_reference_in_the_interpreter():
    results, log = run_checks(BENCHMARKS / "attention_tma.py", [("--check",)], 300)
    assert len(results) == 3 and set(results.values()) == {"ok"}, log[-4000:]
