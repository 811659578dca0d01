"""benchmarks/mixed_gemm.py's Triton candidate GEMM against torch under the CPU interpreter
(float32, M/N not multiples of the tiles), and its layer shapes and floor."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script
from interpreter import run_checks

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_gemm.py"


def test_triton_gemm_matches_torch_in_interpreter():
    results, log = run_checks(SCRIPT, [("--check",)], timeout=300)
    assert len(results) == 6 and set(results.values()) == {"ok"}, log[-4000:]


def test_shapes_and_floor():
    bench = load_script(SCRIPT)
    assert bench.layer_shapes("Llama-3.1-8B") == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)
    }  # fmt: skip
    # 256 tokens of gate_up: 60 GFLOP at 793 TFLOP/s (76 us) outweigh 235 MB at 4.24 TB/s
    assert bench.floor_ms(256, 28672, 4096) == pytest.approx(2 * 256 * 28672 * 4096 / 793e9)
    assert bench.floor_ms(16, 28672, 4096) == pytest.approx(2 * 28672 * 4096 / 4.24e9)
