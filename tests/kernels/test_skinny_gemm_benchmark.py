"""benchmarks/skinny_gemm.py's CPU side on made-up timings: --fp8's defaults, the 8B shapes,
which columns each layer gets, one decode step's totals (FP8 layers with a bf16 LM head, the
FP8 floor) and the tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "skinny_gemm.py"
BW = 4e12  # bytes per second


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


def test_fp8_defaults_and_shapes(bench):
    args = bench.parse_args([])
    assert (args.models, args.batches, args.fp8) == (list(bench.MODELS), bench.BATCHES, False)
    args = bench.parse_args(["--fp8"])
    assert (args.models, args.batches) == (["Llama-3.1-8B"], [1, 8, 16])
    args = bench.parse_args(["--fp8", "--models", "Llama-3.2-1B", "--batches", "2,4"])
    assert (args.models, args.batches) == (["Llama-3.2-1B"], [2, 4])
    assert bench.layer_shapes(bench.MODELS["Llama-3.1-8B"]) == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
        "down": (4096, 14336), "lm_head": (128256, 4096),
    }  # fmt: skip
    fp8_columns = ["cublas", "triton", "triton_fp8", "triton_fp8x", "scaled_mm"]
    assert list(bench.implementations("gate_up+act", fp8=True)) == fp8_columns
    assert list(bench.implementations("lm_head", fp8=True)) == ["cublas", "triton"]  # bf16
    assert list(bench.implementations("qkv")) == ["cublas", "triton"]


def _rows(bench, fp8: bool) -> list[dict]:
    """One batch of the 8B: bf16 times of 10, 20, 30, 40, 50 us per layer (cuBLAS twice the
    Triton time), FP8 ones half the bf16 Triton time (given x in FP8, 0.4 of it), _scaled_mm
    0.8 of it."""
    shapes = bench.layer_shapes(bench.MODELS["Llama-3.1-8B"])
    rows = []
    for i, layer in enumerate(("qkv", "o", "gate_up+act", "down", "lm_head")):
        n, k = shapes["gate_up" if layer == "gate_up+act" else layer]
        us = 10.0 * (i + 1)
        row = {"model": "Llama-3.1-8B", "layer": layer, "N": n, "K": k, "M": 1,
               "weight_bytes": 2 * n * k, "config": {"block_n": 64, "block_k": 128, "split": 1},
               "err": 1e-3, "cublas_us": 2 * us, "triton_us": us}  # fmt: skip
        if fp8 and layer != "lm_head":
            row.update(triton_fp8_us=us / 2, triton_fp8x_us=0.4 * us, scaled_mm_us=0.8 * us,
                       err_fp8=2e-3, err_fp8x=3e-3, fp8_bytes=bench.fp8_bytes(n, k))  # fmt: skip
        rows.append(row)
    return rows


def test_step_totals_on_fp8_weights_keep_the_lm_head_bf16(bench):
    m = bench.MODELS["Llama-3.1-8B"]
    (plain,) = bench.step_totals("Llama-3.1-8B", m, _rows(bench, fp8=False), BW)
    assert "triton_fp8_us" not in plain and "fp8_floor_us" not in plain
    (step,) = bench.step_totals("Llama-3.1-8B", m, _rows(bench, fp8=True), BW)
    layers = m["layers"]  # 32; per layer (qkv, o, gate_up+act, down) 10 + 20 + 30 + 40 us
    assert step["triton_us"] == pytest.approx(layers * 100 + 50)
    assert step["cublas_us"] == pytest.approx(2 * (layers * 100 + 50))
    assert step["triton_fp8_us"] == pytest.approx(layers * 50 + 50)  # the head at bf16 Triton
    assert step["triton_fp8x_us"] == pytest.approx(layers * 40 + 50)
    assert step["scaled_mm_us"] == pytest.approx(layers * 80 + 50)
    shapes = bench.layer_shapes(m)
    per_layer = [shapes[name] for name in ("qkv", "o", "gate_up", "down")]
    head = 2 * 128256 * 4096
    fp8 = layers * sum(n * k + 4 * n for n, k in per_layer) + head
    assert step["fp8_bytes"] == fp8 and step["fp8_floor_us"] == pytest.approx(fp8 / BW * 1e6)
    bf16 = layers * sum(2 * n * k for n, k in per_layer) + head
    assert step["weight_bytes"] == bf16 and step["floor_us"] == pytest.approx(bf16 / BW * 1e6)


def test_tables_show_the_fp8_columns(bench, capsys):
    m = bench.MODELS["Llama-3.1-8B"]
    rows = _rows(bench, fp8=True)
    bench.print_tables(rows, bench.step_totals("Llama-3.1-8B", m, rows, BW), [])
    out = capsys.readouterr().out.splitlines()
    gbps = f"{6144 * (4096 + 4) / 5e3:.0f}"  # qkv's FP8 bytes and scales in 5 us
    qkv = f"| Llama-3.1-8B | qkv | 1 | 20.0 | 10.0 | 5.0 | 4.0 | 8.0 | 0.50 | {gbps} | 2.0e-03 |"
    assert qkv + " 3.0e-03 |" in out
    step = "| Llama-3.1-8B | 1 | 3250 | 1650 | 1330 | 2610 | 0.51 |"
    assert any(line.startswith(step) for line in out)
    assert not any(line.startswith("| Llama-3.1-8B | lm_head | 1 |") for line in out)  # bf16
