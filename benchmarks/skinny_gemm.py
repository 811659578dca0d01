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

`--fp8` (issue 31: FP8 decode): the Llama-3.1-8B shapes at M = 1, 8, 16 unless --models or
--batches say otherwise (the kernel takes up to 64 rows), with two more columns on the decoder
layers' weights in FP8 (one float32 scale per row, as layers/fp8.py keeps them): the skinny GEMM
on them (Triton FP8, what the engine's decode steps run: the default config's dot,
LLM_INFERENCE_FP8_DOT), the same kernel given x already in FP8 (quantized per token before the
timed call, as a norm kernel could hand it over: `x_scale`, the FP8 x FP8 dot on the tiles as
loaded) and the engine's path for larger steps (_scaled_mm: activations quantized
per token, torch._scaled_mm, then silu_and_mul for gate_up+act). `err FP8` compares the Triton
FP8 column with cuBLAS on the dequantized weight (bf16 rounding, and with the FP8 dot the
activations' FP8 rounding). The LM head stays bf16 (its FP8 step totals take its Triton time);
the FP8 floor is the FP8 bytes (and scales) plus the LM head's.

`--sweep` also times other configs (tiles, warps, stages, split-K) of the Triton kernel per
shape at one batch size, to tune `default_config` (with `--fp8`, the kernel on FP8 weights:
their tiles hold half the bytes, so the rule's BLOCK_K may not suit them); it stops after
`--sweep-seconds`. `--sweep-tiles` replaces the tiles swept, `--fp8-dots fp8,w8a16` sweeps
both dots on FP8 weights (GemmConfig.fp8_dot).

    PYTHONPATH=src python3 benchmarks/skinny_gemm.py [--fp8] [--json PATH] [--sweep]
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
from triton.runtime.errors import OutOfResources

from llm_inference.entrypoints.bench import copy_bandwidth
from llm_inference.kernels import skinny_gemm as sg
from llm_inference.kernels.activation import silu_and_mul
from llm_inference.kernels.device import num_sms
from llm_inference.layers.fp8 import fp8_linear, quantize_rows

MODELS = {
    "Llama-3.2-1B": dict(hidden=2048, heads=32, head_dim=64, kv_heads=8, inter=8192,
                         vocab=128256, layers=16),
    "Llama-3.2-3B": dict(hidden=3072, heads=24, head_dim=128, kv_heads=8, inter=8192,
                         vocab=128256, layers=28),
    "Llama-3.1-8B": dict(hidden=4096, heads=32, head_dim=128, kv_heads=8, inter=14336,
                         vocab=128256, layers=32),
}  # fmt: skip
BATCHES = [1, 2, 4, 8, 16]
FP8_MODELS = ["Llama-3.1-8B"]  # --fp8's defaults
FP8_BATCHES = [1, 8, 16]
PER_LAYER = ("qkv", "o", "gate_up+act", "down")  # a decode step's matmuls, with the LM head
FLUSH_BYTES = 200 << 20  # weight copies per case: at least 4x the H200's 50 MB L2
MIN_CALLS = 8  # calls per graph
REPLAYS = 15
DTYPE = torch.bfloat16
DEVICE = "cuda"
# --sweep: (block_n, block_k, num_warps, num_stages) x split_k
SWEEP_TILES = [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4),
               (32, 256, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4),
               (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3)]  # fmt: skip
SWEEP_TILES_FP8 = [(32, 512, 4, 3), (64, 512, 4, 3), (64, 256, 8, 4)]  # FP8 tiles: half the bytes
SWEEP_SPLITS = [1, 2, 4, 8]
SWEEP_MIN_K = 256  # columns per K range, at least
SWEEP_SHOWN = 5  # rows printed per shape (the JSON has all)


def layer_shapes(m: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer's weight."""
    h, q, kv = m["hidden"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * m["inter"], h),
            "down": (h, m["inter"]), "lm_head": (m["vocab"], h)}  # fmt: skip


def fp8_bytes(n: int, k: int) -> int:
    """An FP8 weight's bytes with its float32 row scales."""
    return n * k + 4 * n


def weight_copies(n: int, k: int, fp8: bool = False) -> list:
    """Copies of a random [n, k] weight, FLUSH_BYTES or more in all: bf16 tensors, or (`fp8`)
    (FP8 weight, float32 row scales) pairs quantized as layers/fp8.py does."""
    count = max(2, math.ceil(FLUSH_BYTES / (fp8_bytes(n, k) if fp8 else n * k * DTYPE.itemsize)))
    g = torch.Generator(DEVICE).manual_seed(n * 7 + k)
    copies = []
    for _ in range(count):
        w = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(DTYPE)
        if fp8:
            q, scale = quantize_rows(w)
            w = (q, scale.view(-1))
        copies.append(w)
    return copies


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


def implementations(layer: str, fp8: bool = False, x8: tuple | None = None) -> dict:
    """{column: fn(x, w)} for a layer; gate_up+act runs on the gate_up weights. `fp8` adds
    triton_fp8, triton_fp8x (on `x8`, x quantized per token: FP8 and its scales [M]) and
    scaled_mm, whose w is an (FP8 weight, row scales) pair (not for the LM head, which stays
    bf16)."""
    act = layer == "gate_up+act"
    gemm = sg.skinny_gemm_silu if act else sg.skinny_gemm
    then = silu_and_mul if act else (lambda y: y)
    impls = {"cublas": lambda x, w: then(F.linear(x, w)), "triton": lambda x, w: gemm(x, w)}
    if fp8 and layer != "lm_head":
        impls["triton_fp8"] = lambda x, w: gemm(x, w[0], weight_scale=w[1])
        impls["triton_fp8x"] = lambda x, w: gemm(
            x8[0], w[0], weight_scale=w[1], x_scale=x8[1], out_dtype=x.dtype
        )
        impls["scaled_mm"] = lambda x, w: then(fp8_linear(x, w[0], w[1], None, scaled_mm=True))
    return impls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def run_model(name: str, m: dict, batches: list[int], fp8: bool = False) -> list[dict]:
    rows = []
    sms = num_sms(torch.device(DEVICE))
    for layer, (n, k) in layer_shapes(m).items():
        weights = weight_copies(n, k)
        fp8_weights = weight_copies(n, k, fp8=True) if fp8 and layer != "lm_head" else None
        for shown in [layer, "gate_up+act"] if layer == "gate_up" else [layer]:
            fused = shown == "gate_up+act"
            cfg = sg.default_config(n // 2 if fused else n, k, sms)  # bf16; FP8 takes fp8=True
            for b in batches:
                x = torch.randn(b, k, device=DEVICE, dtype=DTYPE)
                x8 = None  # x quantized per token, for triton_fp8x
                if fp8_weights:
                    q8, s8 = quantize_rows(x)
                    x8 = (q8, s8.view(-1))
                impls = implementations(shown, fp8, x8)
                row = {"model": name, "layer": shown, "N": n, "K": k, "M": b,
                       "weight_bytes": n * k * DTYPE.itemsize,
                       "config": {**cfg.__dict__, "split": sg.split_plan(k, cfg)[0]}}  # fmt: skip
                row["err"] = rel_err(impls["triton"](x, weights[0]), impls["cublas"](x, weights[0]))
                if fp8_weights:
                    q, scale = fp8_weights[0]
                    dense = (q.float() * scale[:, None]).to(DTYPE)
                    row["fp8_bytes"] = fp8_bytes(n, k)
                    row["err_fp8"] = rel_err(impls["triton_fp8"](x, (q, scale)),
                                             impls["cublas"](x, dense))  # fmt: skip
                    row["err_fp8x"] = rel_err(impls["triton_fp8x"](x, (q, scale)),
                                              impls["cublas"](x, dense))  # fmt: skip
                for impl, fn in impls.items():
                    copies = weights if impl in ("cublas", "triton") else fp8_weights
                    row[f"{impl}_us"] = time_calls(lambda w, fn=fn, x=x: fn(x, w), copies)
                rows.append(row)
        del weights, fp8_weights
        torch.cuda.empty_cache()
    return rows


def step_totals(name: str, m: dict, rows: list[dict], floor_bw: float) -> list[dict]:
    """Per batch: one decode step's matmul time summed over layers, each way; with FP8 rows,
    also on FP8 weights (the LM head's bf16 Triton time in both FP8 totals, as the engine
    runs it) and the FP8 floor."""
    out = []
    for b in sorted({r["M"] for r in rows if r["model"] == name}):
        t = {r["layer"]: r for r in rows if r["model"] == name and r["M"] == b}
        picks = {
            "cublas": lambda r: r["cublas_us"],
            "triton": lambda r: r["triton_us"],
            "best": lambda r: min(r["cublas_us"], r["triton_us"]),
        }
        if "triton_fp8_us" in t["qkv"]:
            picks["triton_fp8"] = lambda r: r.get("triton_fp8_us", r["triton_us"])
            picks["triton_fp8x"] = lambda r: r.get("triton_fp8x_us", r["triton_us"])
            picks["scaled_mm"] = lambda r: r.get("scaled_mm_us", r["triton_us"])
        step = {
            f"{key}_us": m["layers"] * sum(pick(t[lay]) for lay in PER_LAYER) + pick(t["lm_head"])
            for key, pick in picks.items()
        }
        head = t["lm_head"]["weight_bytes"]
        nbytes = m["layers"] * sum(t[lay]["weight_bytes"] for lay in PER_LAYER) + head
        step.update(weight_bytes=nbytes, floor_us=nbytes / floor_bw * 1e6)
        if "triton_fp8" in picks:
            fp8 = m["layers"] * sum(t[lay]["fp8_bytes"] for lay in PER_LAYER) + head
            step.update(fp8_bytes=fp8, fp8_floor_us=fp8 / floor_bw * 1e6)
        out.append({"model": name, "M": b, **step})
    return out


def sweep(
    models: list[str], batch: int, seconds: float, fp8: bool = False, tiles: list | None = None,
    dots: tuple[bool, ...] = (True,),
) -> list[dict]:  # fmt: skip
    """Every tile (default SWEEP_TILES; with `fp8`, on FP8 weights: SWEEP_TILES_FP8 too) x
    SWEEP_SPLITS config (K ranges of SWEEP_MIN_K or more) per layer shape at `batch` rows, on
    FP8 weights with each of `dots` (GemmConfig.fp8_dot: True the FP8 x FP8 dot, False W8A16);
    the rule's own config is marked. A
    config that does not fit the GPU (shared memory) is left out."""
    out, deadline = [], time.monotonic() + seconds
    sms = num_sms(torch.device(DEVICE))
    tiles = tiles or (SWEEP_TILES + SWEEP_TILES_FP8 if fp8 else SWEEP_TILES)
    for name in models:
        for layer, (n, k) in layer_shapes(MODELS[name]).items():
            if fp8 and layer == "lm_head":
                continue
            weights = weight_copies(n, k, fp8)
            x = torch.randn(batch, k, device=DEVICE, dtype=DTYPE)
            for fused in (False, True) if layer == "gate_up" else (False,):
                n_out = n // 2 if fused else n
                rule = sg.default_config(n_out, k, sms, fp8=fp8)
                gemm = sg.skinny_gemm_silu if fused else sg.skinny_gemm

                def fn(x, w, config, gemm=gemm):
                    if fp8:
                        return gemm(x, w[0], weight_scale=w[1], config=config)
                    return gemm(x, w, config=config)

                w0 = weights[0]
                dense = (w0[0].float() * w0[1][:, None]).to(DTYPE) if fp8 else w0
                ref = F.linear(x, dense)
                ref = silu_and_mul(ref) if fused else ref
                results = []
                for (bn, bk, warps, stages), split, dot in itertools.product(
                    tiles, SWEEP_SPLITS, dots if fp8 else (True,)
                ):
                    if k // split < SWEEP_MIN_K or time.monotonic() > deadline:
                        continue
                    cfg = sg.GemmConfig(bn, bk, split, warps, stages, fp8_dot=dot)
                    try:
                        us = time_calls(lambda w, cfg=cfg: fn(x, w, cfg), weights)  # noqa: B023
                    except OutOfResources:
                        continue
                    results.append({"model": name, "layer": "gate_up+act" if fused else layer,
                                    "M": batch, "config": cfg.__dict__, "us": us, "fp8": fp8,
                                    "err": rel_err(fn(x, w0, cfg), ref),
                                    "rule": cfg == rule})  # fmt: skip
                out.extend(sorted(results, key=lambda r: r["us"]))
            del weights
            torch.cuda.empty_cache()
    return out


def gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def print_tables(rows, steps, sweep_rows) -> None:
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
    fp8_rows = [r for r in rows if "triton_fp8_us" in r]
    if fp8_rows:
        print("\nFP8 weights: the skinny GEMM on them (Triton FP8) and _scaled_mm (x "
              "quantized per token), against bf16:\n")  # fmt: skip
        print("| model | layer | M | cuBLAS bf16 us | Triton bf16 us | Triton FP8 us "
              "| Triton FP8, x FP8 us | _scaled_mm us | FP8 / bf16 Triton | Triton FP8 GB/s "
              "| err FP8 | err x FP8 |")  # fmt: skip
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in fp8_rows:
            fp8_us = r["triton_fp8_us"]
            print(f"| {r['model']} | {r['layer']} | {r['M']} | {r['cublas_us']:.1f} "
                  f"| {r['triton_us']:.1f} | {fp8_us:.1f} | {r['triton_fp8x_us']:.1f} "
                  f"| {r['scaled_mm_us']:.1f} "
                  f"| {fp8_us / r['triton_us']:.2f} | {gbps(r['fp8_bytes'], fp8_us):.0f} "
                  f"| {r['err_fp8']:.1e} | {r['err_fp8x']:.1e} |")  # fmt: skip
    print("\nOne decode step's matmuls (layers x (qkv + o + gate_up+act + down) + LM head):\n")
    print("| model | M | cuBLAS us | Triton us | best per shape us | floor us | Triton GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in steps:
        print(f"| {s['model']} | {s['M']} | {s['cublas_us']:.0f} | {s['triton_us']:.0f} "
              f"| {s['best_us']:.0f} | {s['floor_us']:.0f} "
              f"| {gbps(s['weight_bytes'], s['triton_us']):.0f} |")  # fmt: skip
    fp8_steps = [s for s in steps if "triton_fp8_us" in s]
    if fp8_steps:
        print("\nThe same step on FP8 weights (the LM head bf16, Triton):\n")
        print("| model | M | Triton bf16 us | Triton FP8 us | Triton FP8, x FP8 us "
              "| _scaled_mm us | FP8 / bf16 Triton | FP8 floor us | Triton FP8 GB/s |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for s in fp8_steps:
            fp8_us = s["triton_fp8_us"]
            print(f"| {s['model']} | {s['M']} | {s['triton_us']:.0f} | {fp8_us:.0f} "
                  f"| {s['triton_fp8x_us']:.0f} | {s['scaled_mm_us']:.0f} "
                  f"| {fp8_us / s['triton_us']:.2f} "
                  f"| {s['fp8_floor_us']:.0f} | {gbps(s['fp8_bytes'], fp8_us):.0f} |")  # fmt: skip
    if sweep_rows:
        print(f"\nSweep: the {SWEEP_SHOWN} fastest per shape, the fastest of each FP8 dot and the "
              "rule's config (*):\n")  # fmt: skip
        print("| model | layer | M | BN | BK | warps | stages | split | FP8 dot | us | err |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
        shown = []
        for _, group in itertools.groupby(sweep_rows, key=lambda r: (r["model"], r["layer"])):
            group = list(group)
            dots = {r["config"]["fp8_dot"]: r for r in reversed(group)}  # each dot's fastest
            top = group[:SWEEP_SHOWN]
            shown += top + [r for r in group if r not in top and (r["rule"] or r in dots.values())]
        for r in shown:
            c = r["config"]
            print(f"| {r['model']} | {r['layer']} | {r['M']} | {c['block_n']} | {c['block_k']} "
                  f"| {c['num_warps']} | {c['num_stages']} | {c['split_k']} "
                  f"| {('fp8' if c['fp8_dot'] else 'w8a16') if r['fp8'] else '-'} "
                  f"| {r['us']:.1f}{' *' if r['rule'] else ''} | {r['err']:.1e} |")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options; `models` and `batches` as lists, --fp8's defaults applied."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help="comma-separated (default: all; with --fp8, the 8B)")
    p.add_argument("--batches", help="rows, <= 64 (default: 1,2,4,8,16; with --fp8, 1,8,16)")
    p.add_argument("--fp8", action="store_true", help="also the decoder layers on FP8 weights")
    p.add_argument("--sweep", action="store_true", help="also time other Triton configs")
    p.add_argument("--sweep-batch", type=int, default=1, help="rows of the sweep")
    p.add_argument("--sweep-seconds", type=float, default=90.0, help="the sweep's time budget")
    p.add_argument("--sweep-tiles", help="BN,BK,warps,stages;... (default: SWEEP_TILES)")
    p.add_argument("--fp8-dots", default="fp8", help="the sweep's FP8 dots: fp8,w8a16")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    default_models, default_batches = (FP8_MODELS, FP8_BATCHES) if args.fp8 else (MODELS, BATCHES)
    args.models = args.models.split(",") if args.models else list(default_models)
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else default_batches
    tiles = (args.sweep_tiles or "").split(";")
    args.sweep_tiles = [tuple(int(v) for v in tile.split(",")) for tile in tiles if tile]
    args.fp8_dots = tuple({"fp8": True, "w8a16": False}[d] for d in args.fp8_dots.split(","))
    return args


def main() -> None:
    args = parse_args()
    assert torch.cuda.is_available(), "benchmarks/skinny_gemm.py needs a CUDA GPU"
    started = time.monotonic()
    bw = copy_bandwidth()
    rows, steps = [], []
    for name in args.models:
        model_rows = run_model(name, MODELS[name], args.batches, args.fp8)
        rows += model_rows
        steps += step_totals(name, MODELS[name], model_rows, bw)
    sweep_rows = []
    if args.sweep:
        sweep_rows = sweep(
            args.models, args.sweep_batch, args.sweep_seconds, args.fp8, args.sweep_tiles,
            args.fp8_dots,
        )  # fmt: skip
    dtype = str(DTYPE).removeprefix("torch.")
    print(f"{torch.cuda.get_device_name()}, {dtype}, copy bandwidth {bw / 1e12:.2f} TB/s\n")
    print_tables(rows, steps, sweep_rows)
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
