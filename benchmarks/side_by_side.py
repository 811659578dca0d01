"""Tables and a plot from one GPU machine start: this engine, vLLM and transformers, back to back.

Reads a folder of JSON results, one table row per SHAPE with an `ours_SHAPE_latency.json`:
`ours_SHAPE_{latency,throughput,prefill}.json` (written by `llm-inference bench ... --json`),
`vllm_SHAPE.json` (../shared/vllm/vllm_bench.py for the Llama 3.2 shapes, else
benchmarks/vllm_throughput.py --latency: the same decode keys, its own throughput keys),
`vllm_prefill_SHAPE.txt` (prefill_bench.py's output, optional), `hf_SHAPE.json`
(benchmarks/hf_decode.py) and the mixes `{ours,vllm}_SHAPE_mix_NAME.json` (scripts/gpu_vs_vllm.sh
MIXES=1); writes a markdown table (and one of the mixes, where there are any) and a PNG of
decode ms per step against batch size (one panel per shape: ours, vLLM, transformers, floor);
with mixes also OUT_mixes.png, each engine's output tok/s over vLLM's per mix. A mix's
`other_SHAPE_mix_NAME.json` (gpu_vs_vllm.sh OTHER_SRC=) joins both, named OTHER_NAME.

    python3 benchmarks/side_by_side.py RESULTS_DIR OUT.md OUT.png [OTHER_NAME]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BATCHES = (1, 8, 64, 256)


def load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def vllm_prefill(folder: Path, shape: str) -> dict:
    path = folder / f"vllm_prefill_{shape}.txt"
    if not path.is_file():
        return {}
    found = re.findall(r"prefill (\S+): ([\d.]+) ms", path.read_text())
    return {name: float(ms) for name, ms in found}


def collect(folder: Path, shape: str) -> dict:
    lat = load(folder, f"ours_{shape}_latency.json") or {}
    thr = load(folder, f"ours_{shape}_throughput.json") or {}
    pre = load(folder, f"ours_{shape}_prefill.json") or {}
    vl = load(folder, f"vllm_{shape}.json") or {}
    hf = (load(folder, f"hf_{shape}.json") or {}).get("decode_ms_per_step", {})
    row = {"ours": {}, "vllm": {}, "hf": {}, "floor": {}}
    for bs in BATCHES:
        if f"bs{bs}" in lat:
            row["ours"][bs] = lat[f"bs{bs}"]["ms_per_step"]
            row["floor"][bs] = lat[f"bs{bs}"]["floor_ms"]
        if f"decode_ms_per_step_bs{bs}" in vl:
            row["vllm"][bs] = vl[f"decode_ms_per_step_bs{bs}"]
        if str(bs) in hf:
            row["hf"][bs] = hf[str(bs)]
    row["ours_tput"] = thr.get("output_tok_per_s")
    # vllm_throughput.py's key (bench throughput's), or vllm_bench.py's
    row["vllm_tput"] = vl.get("output_tok_per_s") or vl.get("throughput", {}).get("out_tok_per_s")
    row["ours_prefill"] = {k.split("_")[1]: v for k, v in pre.items() if k.startswith("prefill_")}
    row["vllm_prefill"] = vllm_prefill(folder, shape)
    row["profile"] = {k: v for k, v in lat.items() if k.startswith("profile_bs")}
    row["bw"] = lat.get("copy_bandwidth_TBps")
    return row


def fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(rows: dict) -> str:
    lines = [
        "| shape | engine | " + " | ".join(f"bs{b} ms/step" for b in BATCHES) + " | out tok/s |",
        "|---|---|" + "---|" * (len(BATCHES) + 1),
    ]
    names = {"ours": "llm_inference", "vllm": "vLLM 0.26.0", "hf": "transformers", "floor": "floor"}
    for shape, row in rows.items():
        for key, name in names.items():
            tput = {"ours": row["ours_tput"], "vllm": row["vllm_tput"]}.get(key)
            cells = [fmt(row[key].get(b)) for b in BATCHES]
            lines.append(f"| {shape} | {name} | " + " | ".join(cells) + f" | {fmt(tput, 0)} |")
        if row["ours_tput"] and row["vllm_tput"]:
            ratio = row["ours_tput"] / row["vllm_tput"]
            dec = [
                fmt(row["vllm"][b] / row["ours"][b], 2) if b in row["vllm"] and b in row["ours"]
                else "-"
                for b in BATCHES
            ]  # fmt: skip
            lines.append(f"| {shape} | vLLM / ours | " + " | ".join(dec) + f" | {ratio:.2f}x |")
    lines += ["", "| shape | prefill | llm_inference ms | vLLM ms |", "|---|---|---|---|"]
    for shape, row in rows.items():
        for case, ms in row["ours_prefill"].items():
            lines.append(
                f"| {shape} | {case} | {ms:.1f} | {fmt(row['vllm_prefill'].get(case), 1)} |"
            )
    lines += [
        "",
        "| shape | batch | wall ms/step | GPU kernel ms/step | host gap ms |",
        "|---|---|---|---|---|",
    ]
    for shape, row in rows.items():
        for key, p in row["profile"].items():
            gap = p["wall_ms_per_step"] - p["gpu_ms_per_step"]
            lines.append(f"| {shape} | {key[10:]} | {p['wall_ms_per_step']:.3f} | "
                         f"{p['gpu_ms_per_step']:.3f} | {gap:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(rows) :]:
        ax.remove()
    styles = {
        "ours": ("llm_inference", "o-"),
        "vllm": ("vLLM 0.26.0", "s-"),
        "hf": ("transformers", "^-"),
        "floor": ("floor (bytes / bandwidth)", "k--"),
    }
    for ax, (shape, row) in zip(axes.flat, rows.items()):
        for key, (label, style) in styles.items():
            pts = sorted(row[key].items())
            if pts:
                ax.plot([b for b, _ in pts], [v for _, v in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
        ax.set_xlabel("batch size (decoding sequences)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{shape.replace('_tp2', ', TP=2')}, bf16, H200")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def mix_rows(folder: Path) -> list[dict]:
    """One row per mix that ours and vLLM both ran (`{ours,vllm,other}_SHAPE_mix_NAME.json`):
    each engine's bench JSON, `other` None where no other tree ran it."""
    rows = []
    for path in sorted(folder.glob("ours_*_mix_*.json")):
        vl = load(folder, path.name.replace("ours_", "vllm_", 1))
        if vl is None:
            continue
        shape, mix = path.stem.removeprefix("ours_").split("_mix_")
        other = load(folder, path.name.replace("ours_", "other_", 1))
        rows.append(dict(shape=shape, mix=mix, ours=load(folder, path.name), vllm=vl, other=other))
    return rows


def mix_table(rows: list[dict], other_name: str) -> str:
    """Ours (and the other tree's) against vLLM on each mix: output and total tok/s, ratios."""
    if not rows:
        return ""
    lines = [
        "",
        "| shape | mix | engine | out tok/s | total tok/s | / vLLM |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        w = r["ours"]["workload"]
        n, lin, lout = w["num_prompts"], w["mean_prompt_len"], w["mean_output_len"]
        what = f"{n} x {lin:.0f} in / {lout:.0f} out"
        for key, name in (("ours", "llm_inference"), ("other", other_name), ("vllm", "vLLM")):
            run = r[key]
            if run is not None:
                ratio = run["output_tok_per_s"] / r["vllm"]["output_tok_per_s"]
                lines.append(f"| {r['shape']} | {r['mix']} ({what}) | {name} | "
                             f"{run['output_tok_per_s']:,.0f} | {run['total_tok_per_s']:,.0f} | "
                             f"{ratio:.3f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot_mixes(rows: list[dict], path: Path, other_name: str) -> None:
    """Bars: each engine's output tok/s over vLLM's, per mix and shape; a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [("ours", "llm_inference")] + (
        [("other", other_name)] if any(r["other"] for r in rows) else []
    )
    fig, ax = plt.subplots(figsize=(2 + (0.8 + 0.5 * len(engines)) * len(rows), 4.2))
    width = 0.8 / len(engines)
    for i, (key, name) in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(rows))]
        ratios = [
            r[key]["output_tok_per_s"] / r["vllm"]["output_tok_per_s"] if r[key] else 0
            for r in rows
        ]
        bars = ax.bar(xs, ratios, width, label=name)
        ax.bar_label(bars, [f"{v:.3f}" if v else "" for v in ratios], fontsize=7)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="vLLM 0.26.0")
    ax.set_xticks(range(len(rows)), [f"{r['shape']}\n{r['mix']}" for r in rows], fontsize=8)
    ax.set_ylabel("output tok/s / vLLM's (same start)")
    ax.set_title("Realistic mixes against vLLM, bf16, H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    folder, out_md, out_png = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    # SHAPE[_tpN]: a named shape, at tensor parallel size N in both engines
    found = folder.glob("ours_*_latency.json")
    shapes = sorted(p.name.removeprefix("ours_").removesuffix("_latency.json") for p in found)
    rows = {s: collect(folder, s) for s in shapes}
    mixes = mix_rows(folder)
    other_name = sys.argv[4] if len(sys.argv) > 4 else "other tree"
    out_md.write_text((table(rows) if rows else "") + mix_table(mixes, other_name))
    if rows:
        plot(rows, out_png)
    if mixes:
        plot_mixes(mixes, out_png.with_name(out_png.stem + "_mixes.png"), other_name)
    print(out_md.read_text())


if __name__ == "__main__":
    main()
