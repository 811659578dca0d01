"""benchmarks/side_by_side.py on made-up results: a row per shape measured, vLLM's figures read
from either writer's JSON (vllm_bench.py's for Llama 3.2, vllm_throughput.py --latency's for the
other families)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "side_by_side.py"


def _script():
    return load_script(SCRIPT)


def _write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


def test_a_row_per_shape_with_either_vllm_json(tmp_path, monkeypatch, capsys):
    batches = (1, 8, 64, 256)
    ours = {"llama-3.2-1b": 2.0, "qwen3-8b": 7.0}
    for shape, ms in ours.items():
        lat = {f"bs{b}": {"ms_per_step": ms * b, "floor_ms": ms * b / 2} for b in batches}
        _write(tmp_path, f"ours_{shape}_latency.json", {**lat, "copy_bandwidth_TBps": 4.0})
        _write(tmp_path, f"ours_{shape}_throughput.json", {"output_tok_per_s": 10000.0})
    vllm_decode = {f"decode_ms_per_step_bs{b}": 8.0 * b for b in batches}
    # vllm_bench.py's throughput, nested; vllm_throughput.py's, bench throughput's keys
    _write(
        tmp_path, "vllm_llama-3.2-1b.json", {**vllm_decode, "throughput": {"out_tok_per_s": 5e3}}
    )
    _write(tmp_path, "vllm_qwen3-8b.json", {**vllm_decode, "output_tok_per_s": 9000.0})
    out_md, out_png = tmp_path / "table.md", tmp_path / "plot.png"
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", str(tmp_path), str(out_md), str(out_png)])
    _script().main()
    lines = out_md.read_text().splitlines()
    assert "| qwen3-8b | llm_inference | 7.000 | 56.000 | 448.000 | 1,792.000 | 10,000 |" in lines
    assert "| qwen3-8b | vLLM 0.26.0 | 8.000 | 64.000 | 512.000 | 2,048.000 | 9,000 |" in lines
    assert "| qwen3-8b | vLLM / ours | 1.14 | 1.14 | 1.14 | 1.14 | 1.11x |" in lines
    assert "| llama-3.2-1b | vLLM / ours | 4.00 | 4.00 | 4.00 | 4.00 | 2.00x |" in lines
    assert out_png.stat().st_size > 0 and "qwen3-8b" in capsys.readouterr().out


def test_mixes_get_a_row_per_engine_and_a_plot_of_their_ratios(tmp_path, monkeypatch):
    def run(out_tok_s: float) -> dict:
        workload = {"num_prompts": 16, "mean_prompt_len": 12000.0, "mean_output_len": 256.0}
        return {
            "output_tok_per_s": out_tok_s,
            "total_tok_per_s": 47 * out_tok_s,
            "workload": workload,
        }

    _write(tmp_path, "ours_llama-3.1-8b_mix_long.json", run(475.0))
    _write(tmp_path, "other_llama-3.1-8b_mix_long.json", run(494.0))
    _write(tmp_path, "vllm_llama-3.1-8b_mix_long.json", run(500.0))
    _write(tmp_path, "ours_llama-3.1-8b_mix_chat.json", run(7000.0))  # no vLLM run: no row
    out_md, out_png = tmp_path / "table.md", tmp_path / "plot.png"
    argv = ["side_by_side.py", str(tmp_path), str(out_md), str(out_png), "fa4-prompts"]
    monkeypatch.setattr(sys, "argv", argv)
    _script().main()
    lines = out_md.read_text().splitlines()
    what = "| llama-3.1-8b | long (16 x 12000 in / 256 out) |"
    assert f"{what} llm_inference | 475 | 22,325 | 0.950x |" in lines
    assert f"{what} fa4-prompts | 494 | 23,218 | 0.988x |" in lines
    assert f"{what} vLLM | 500 | 23,500 | 1.000x |" in lines
    assert not any("chat" in line for line in lines)
    assert (tmp_path / "plot_mixes.png").stat().st_size > 0 and not out_png.exists()
