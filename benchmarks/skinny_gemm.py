"""Decode-sized matmuls on the GPU: cuBLAS (F.linear) against the Triton skinny GEMM
(kernels/skinny_gemm.py) at the Llama-3.2-1B and 3B shapes, bfloat16, M = 1, 2, 4, 8, 16 rows.

Layers per model: qkv, o, gate_up, down (one decoder layer's) and the LM head; `gate_up+act` is
the MLP's first half as the engine runs it: F.linear then our Triton silu_and_mul (cuBLAS
column) against the fused skinny_gemm_silu (Triton column).

Timing: each case is a CUDA graph of many calls, each call on another copy of the weights, with
enough copies (at least 200 MB, 4x the H200's 50 MB L2) that every call reads its weights from
HBM, not L2; x stays in L2, as in a real step. Time per call = median replay time / calls
(launch gaps inside the graph included, as in the engine's graphs). GB/s = weight bytes / time.
`err`: max |Triton - cuBLAS| / max |cuBLAS| on one call (a sanity check, bf16 rounding ~4e-3).
Step totals sum one decode step's matmuls: layers x (qkv + o + gate_up+act + down) + LM head;
`best` takes the faster of the two per layer shape (what a per-shape dispatch would get); the
floor is the weight bytes at the measured device-to-device copy bandwidth.

`--sweep` also times other configs (tiles, warps, stages, split-K) of the Triton kernel per
shape at one batch size, to tune `default_config`; it stops after `--sweep-seconds`.

    PYTHONPATH=src python3 benchmarks/skinny_gemm.py [--json PATH] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from llm_inference.entrypoints.bench import copy_bandwidth
from llm_inference.kernels import skinny_gemm as sg
from llm_inference.kernels.activation import silu_and_mul
from llm_inference.kernels.device import num_sms

MODELS = {
    "Llama-3.2-1B": dict(hidden=2048, heads=32, head_dim=64, kv_heads=8, inter=8192,
                         vocab=128256, layers=16),
    "Llama-3.2-3B": dict(hidden=3072, heads=24, head_dim=128, kv_heads=8, inter=8192,
                         vocab=128256, layers=28),
}  # fmt: skip
BATCHES = [1, 2, 4, 8, 16]
FLUSH_BYTES = 200 << 20  # weight copies per case: at least 4x the H200's 50 MB L2
MIN_CALLS = 8  # calls per graph
REPLAYS = 15
DTYPE = torch.bfloat16
DEVICE = "cuda"
# --sweep: (block_n, block_k, num_warps, num_stages) x split_k
SWEEP_TILES = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4),
               (32, 256, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4),
               (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3)]  # fmt: skip
SWEEP_SPLITS = [1, 2, 4, 8]
SWEEP_MIN_K = 256  # columns per K range, at least
SWEEP_SHOWN = 5  # rows printed per shape (the JSON has all)


def layer_shapes(m: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer's weight."""
    h, q, kv = m["hidden"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * m["inter"], h),
            "down": (h, m["inter"]), "lm_head": (m["vocab"], h)}  # fmt: skip


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    count = max(2, math.ceil(FLUSH_BYTES / (n * k * DTYPE.itemsize)))
    g = torch.Generator(DEVICE).manual_seed(n * 7 + k)
    return [(torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(DTYPE)
            for _ in range(count)]  # fmt: skip


def time_calls(fn, weights: list[torch.Tensor]) -> float:
    """Microseconds per call of fn(w), the calls cycling over `weights` in one CUDA graph."""
    calls = len(weights) * math.ceil(MIN_CALLS / len(weights))
    for w in weights[:1]:
        fn(w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / calls


def implementations(layer: str):
    """{column: fn(x, w)} for a layer; gate_up+act runs on the gate_up weights."""
    if layer == "gate_up+act":
        return {"cublas": lambda x, w: silu_and_mul(F.linear(x, w)),
                "triton": lambda x, w: sg.skinny_gemm_silu(x, w)}  # fmt: skip
    return {"cublas": F.linear, "triton": lambda x, w: sg.skinny_gemm(x, w)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def run_model(name: str, m: dict, batches: list[int]) -> list[dict]:
    rows = []
    sms = num_sms(torch.device(DEVICE))
    for layer, (n, k) in layer_shapes(m).items():
        weights = weight_copies(n, k)
        for shown in [layer, "gate_up+act"] if layer == "gate_up" else [layer]:
            fused = shown == "gate_up+act"
            cfg = sg.default_config(n // 2 if fused else n, k, sms)
            for b in batches:
                x = torch.randn(b, k, device=DEVICE, dtype=DTYPE)
                impls = implementations(shown)
                row = {"model": name, "layer": shown, "N": n, "K": k, "M": b,
                       "weight_bytes": n * k * DTYPE.itemsize,
                       "config": {**cfg.__dict__, "split": sg.split_plan(k, cfg)[0]}}  # fmt: skip
                row["err"] = rel_err(impls["triton"](x, weights[0]), impls["cublas"](x, weights[0]))
                for impl, fn in impls.items():
                    row[f"{impl}_us"] = time_calls(lambda w, fn=fn, x=x: fn(x, w), weights)
                rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def step_totals(name: str, m: dict, rows: list[dict], floor_bw: float) -> list[dict]:
    """Per batch: one decode step's matmul time summed over layers, each way."""
    per_layer = ("qkv", "o", "gate_up+act", "down")
    out = []
    for b in sorted({r["M"] for r in rows if r["model"] == name}):
        t = {r["layer"]: r for r in rows if r["model"] == name and r["M"] == b}
        picks = {
            "cublas": lambda r: r["cublas_us"],
            "triton": lambda r: r["triton_us"],
            "best": lambda r: min(r["cublas_us"], r["triton_us"]),
        }
        total = {
            key: m["layers"] * sum(pick(t[lay]) for lay in per_layer) + pick(t["lm_head"])
            for key, pick in picks.items()
        }
        nbytes = m["layers"] * sum(t[lay]["weight_bytes"] for lay in per_layer)
        nbytes += t["lm_head"]["weight_bytes"]
        out.append({"model": name, "M": b, **{f"{k}_us": v for k, v in total.items()},
                    "weight_bytes": nbytes, "floor_us": nbytes / floor_bw * 1e6})  # fmt: skip
    return out


def sweep(models: list[str], batch: int, seconds: float) -> list[dict]:
    """Every SWEEP_TILES x SWEEP_SPLITS config (K ranges of SWEEP_MIN_K or more) per
    layer shape at `batch` rows; the rule's own config is marked."""
    out, deadline = [], time.monotonic() + seconds
    sms = num_sms(torch.device(DEVICE))
    for name in models:
        for layer, (n, k) in layer_shapes(MODELS[name]).items():
            weights = weight_copies(n, k)
            x = torch.randn(batch, k, device=DEVICE, dtype=DTYPE)
            for fused in (False, True) if layer == "gate_up" else (False,):
                n_out = n // 2 if fused else n
                rule = sg.default_config(n_out, k, sms)
                fn = sg.skinny_gemm_silu if fused else sg.skinny_gemm
                results = []
                for (bn, bk, warps, stages), split in itertools.product(SWEEP_TILES, SWEEP_SPLITS):
                    if k // split < SWEEP_MIN_K or time.monotonic() > deadline:
                        continue
                    cfg = sg.GemmConfig(bn, bk, split, warps, stages)
                    us = time_calls(lambda w, cfg=cfg: fn(x, w, config=cfg), weights)  # noqa: B023
                    results.append({"model": name, "layer": "gate_up+act" if fused else layer,
                                    "M": batch, "config": cfg.__dict__, "us": us,
                                    "rule": cfg == rule})  # fmt: skip
                out.extend(sorted(results, key=lambda r: r["us"]))
            del weights
            torch.cuda.empty_cache()
    return out


def gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def print_tables(rows, steps, sweep_rows, bw) -> None:
    dtype = str(DTYPE).removeprefix("torch.")
    print(f"{torch.cuda.get_device_name()}, {dtype}, copy bandwidth {bw / 1e12:.2f} TB/s\n")
    print("| model | layer | N x K | M | cuBLAS us | Triton us | speedup | cuBLAS GB/s "
          "| Triton GB/s | config (BN, BK, split) | err |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        c = r["config"]
        print(f"| {r['model']} | {r['layer']} | {r['N']}x{r['K']} | {r['M']} "
              f"| {r['cublas_us']:.1f} | {r['triton_us']:.1f} "
              f"| {r['cublas_us'] / r['triton_us']:.2f}x "
              f"| {gbps(r['weight_bytes'], r['cublas_us']):.0f} "
              f"| {gbps(r['weight_bytes'], r['triton_us']):.0f} "
              f"| {c['block_n']}, {c['block_k']}, {c['split']} | {r['err']:.1e} |")  # fmt: skip
    print("\nOne decode step's matmuls (layers x (qkv + o + gate_up+act + down) + LM head):\n")
    print("| model | M | cuBLAS us | Triton us | best per shape us | floor us | Triton GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in steps:
        print(f"| {s['model']} | {s['M']} | {s['cublas_us']:.0f} | {s['triton_us']:.0f} "
              f"| {s['best_us']:.0f} | {s['floor_us']:.0f} "
              f"| {gbps(s['weight_bytes'], s['triton_us']):.0f} |")  # fmt: skip
    if sweep_rows:
        print(f"\nSweep: the {SWEEP_SHOWN} fastest per shape and the rule's config (*):\n")
        print("| model | layer | M | BN | BK | warps | stages | split | us |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        shown = []
        for _, group in itertools.groupby(sweep_rows, key=lambda r: (r["model"], r["layer"])):
            group = list(group)
            shown += group[:SWEEP_SHOWN] + [r for r in group[SWEEP_SHOWN:] if r["rule"]]
        for r in shown:
            c = r["config"]
            print(f"| {r['model']} | {r['layer']} | {r['M']} | {c['block_n']} | {c['block_k']} "
                  f"| {c['num_warps']} | {c['num_stages']} | {c['split_k']} "
                  f"| {r['us']:.1f}{' *' if r['rule'] else ''} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="rows, <= 16")
    p.add_argument("--sweep", action="store_true", help="also time other Triton configs")
    p.add_argument("--sweep-batch", type=int, default=1, help="rows of the sweep")
    p.add_argument("--sweep-seconds", type=float, default=90.0, help="the sweep's time budget")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()
    assert torch.cuda.is_available(), "benchmarks/skinny_gemm.py needs a CUDA GPU"
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    started = time.monotonic()
    bw = copy_bandwidth()
    rows, steps = [], []
    for name in models:
        model_rows = run_model(name, MODELS[name], batches)
        rows += model_rows
        steps += step_totals(name, MODELS[name], model_rows, bw)
    sweep_rows = sweep(models, args.sweep_batch, args.sweep_seconds) if args.sweep else []
    print_tables(rows, steps, sweep_rows, bw)
    print(f"\n{time.monotonic() - started:.0f} s")
    if args.json:
        result = {
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(),
            "copy_bandwidth_Bps": bw,
            "torch": torch.__version__,
            "rows": rows,
            "steps": steps,
            "sweep": sweep_rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
