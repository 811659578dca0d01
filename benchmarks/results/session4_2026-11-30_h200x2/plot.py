"""Decode ms per step against batch size, this session's H200 runs: the day's base (cuBLAS
decode matmuls, call 2) and the final code (skinny GEMM on, per-sequence decode splits, call
4-5), with the floor from the same runs. python3 plot.py (writes decode_latency.png here)."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = {
    "1B": ("skinny_ab/llama-3.2-1b_tp1_base_latency.json", "final/ours_llama-3.2-1b_latency.json"),
    "3B": ("skinny_ab/llama-3.2-3b_tp1_base_latency.json", "final/ours_llama-3.2-3b_latency.json"),
    "3B TP=2": (
        "skinny_ab/llama-3.2-3b_tp2_base_latency.json",
        "final/ours_llama-3.2-3b_tp2_latency.json",
    ),
}
fig, axes = plt.subplots(1, 3, figsize=(13, 4))
for ax, (name, (base, final)) in zip(axes, RUNS.items()):
    for label, path, style in (("base (call 2)", base, "o--"), ("final (calls 4-5)", final, "o-")):
        d = json.loads((HERE / path).read_text())
        rows = sorted((int(k[2:]), v) for k, v in d.items() if k.startswith("bs"))
        ax.plot([b for b, _ in rows], [v["ms_per_step"] for _, v in rows], style, label=label)
    ax.plot([b for b, _ in rows], [v["floor_ms"] for _, v in rows], "k:", label="floor")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{name} decode, H200")
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per step")
    ax.grid(alpha=0.3)
    ax.legend()
fig.tight_layout()
fig.savefig(HERE / "decode_latency.png", dpi=110)
