"""Where the GPU waits during decode: idle gaps between kernels, and what the host did then.

`bench latency --profile` gives wall minus GPU-kernel time per step (host time the GPU waits
for) but not where it goes. This runs `--steps` decode steps at `--batch` (128-token random
prompts, greedy, ignore_eos; async scheduling as `LLM.generate` runs it) under the engine's
profiler with a Chrome trace, then from the trace: the GPU's busy and idle time over the
decode steps, the idle gaps by size, and for the largest gaps the CUDA runtime calls and
operators on the host that overlap them (e.g. a synchronize, a copy, the graph launch). The
profiler slows the host, so absolute gaps are upper bounds; the order of the causes is what
to read. One process (TP=1).

    PYTHONPATH=src python3 benchmarks/decode_gaps.py [--model llama-3.2-1b] [--batch 64]
        [--steps 40] [--json PATH] [--trace-dir DIR]
    PYTHONPATH=src python3 benchmarks/decode_gaps.py --throughput [--slices 20]

`--throughput` profiles the whole 256-request run of `bench throughput` instead: busy and
idle over the run, and per slice of time the busy fraction and the decode steps launched.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import random
import tempfile
from pathlib import Path

VOCAB = 128_256
BUCKETS = [(5, "<5 us"), (50, "5-50 us"), (200, "50-200 us")]  # gap sizes, else ">=200 us"


def busy_intervals(kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge [start, end) intervals (us) into disjoint, sorted ones."""
    merged: list[list[float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def analyse(trace: dict, top: int = 8, whole: bool = False, slices: int = 0) -> dict:
    """GPU busy/idle over the decode window of a Chrome trace, the gaps by size, and the host
    events overlapping the `top` largest gaps. The window starts after the longest kernel
    (the prefill of the prompts), or at the first kernel if `whole`, and ends at the last
    kernel. `slices` > 0: also the window cut into that many equal spans of time, each with its
    GPU busy fraction and the CUDA graph launches (decode steps) the host made in it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise ValueError("no GPU kernels in the trace")
    if whole:
        start = min(e["ts"] for e in kernels)
    else:
        prefill = max(kernels, key=lambda e: e["dur"])
        start = prefill["ts"] + prefill["dur"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if e["ts"] >= start]
    busy = busy_intervals(spans)
    end = busy[-1][1]
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:])]
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cpu_op", "user_annotation")]
    sizes = collections.Counter()
    totals = collections.Counter()
    for size, _, _ in gaps:
        bucket = next((name for limit, name in BUCKETS if size < limit), ">=200 us")
        sizes[bucket] += 1
        totals[bucket] += size
    largest = []
    for size, a, b in sorted(gaps, reverse=True)[:top]:
        names = collections.Counter()
        for e in host:
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0.2 * size or overlap > 20:
                names[e["name"][:60]] += round(overlap, 1)
        largest.append({"gap_us": round(size, 1), "host": names.most_common(6)})
    window = end - start
    idle = sum(s for s, _, _ in gaps)
    out = {
        "window_us": window,
        "busy_us": window - idle,
        "idle_us": idle,
        "gaps": {k: {"count": sizes[k], "us": round(totals[k], 1)} for k in sizes},
        "largest": largest,
    }
    if slices:
        width = window / slices
        launches = [e["ts"] for e in host if e["name"] == "cudaGraphLaunch"]
        out["slices"] = [
            {
                "busy": round(
                    _overlap(busy, start + i * width, start + (i + 1) * width) / width, 3
                ),
                "graph_launches": sum(
                    start + i * width <= t < start + (i + 1) * width for t in launches
                ),
            }  # fmt: skip
            for i in range(slices)
        ]
        out["slice_ms"] = width / 1e3
        by_name = collections.defaultdict(lambda: [0.0, 0])
        for e in kernels:
            by_name[e["name"]][0] += e["dur"]
            by_name[e["name"]][1] += 1
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
        out["kernels"] = [
            {"name": n, "ms": round(us / 1e3, 3), "calls": c} for n, (us, c) in ranked
        ]
    return out


def _overlap(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in intervals)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--throughput", action="store_true",
        help="profile the 256-request throughput run instead (bench throughput's settings, "
        "token ids only), the whole run, in --slices spans of time",
    )  # fmt: skip
    p.add_argument("--slices", type=int, default=20)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    from llm_inference import LLM, SamplingParams
    from llm_inference.entrypoints.bench import random_checkpoint, throughput

    folder = random_checkpoint(args.model)
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp())
    if args.throughput:  # as `bench throughput --disable-detokenize`
        kw = dict(max_model_len=4096, gpu_memory_utilization=0.85, max_num_seqs=256)
    else:
        kw = dict(max_model_len=1024, kv_cache_memory_bytes=4 << 30,
                  max_num_seqs=max(256, args.batch))  # fmt: skip
    with LLM(str(folder), dtype="bfloat16", enable_prefix_caching=False, **kw) as llm:
        if args.throughput:
            run = functools.partial(throughput, llm, detokenize=False)
            unprofiled = run()
            run = functools.partial(run, warmup=False)
        else:
            rng = random.Random(0)
            prompts = [[rng.randrange(VOCAB - 256) for _ in range(128)] for _ in range(args.batch)]
            params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
            run = functools.partial(llm.generate, prompts, params, use_tqdm=False)
            for _ in range(2):
                run()
        llm.start_profile(str(trace_dir))
        run()
        torch.cuda.synchronize()
        llm.stop_profile()
    with open(trace_dir / "rank0.json") as f:
        result = analyse(json.load(f), whole=args.throughput,
                         slices=args.slices if args.throughput else 0)  # fmt: skip
    result.update(model=args.model, device=torch.cuda.get_device_name())
    if args.throughput:
        result.update(unprofiled=unprofiled)
        print(f"{args.model} throughput run: unprofiled {unprofiled['seconds']:.3f} s "
              f"({unprofiled['output_tok_per_s']:,.0f} output tok/s); profiled window "
              f"{result['window_us'] / 1e6:.3f} s, GPU busy {result['busy_us'] / 1e6:.3f} s, "
              f"idle {result['idle_us'] / 1e6:.3f} s")  # fmt: skip
        print(f"slices of {result['slice_ms']:.1f} ms: busy fraction / graph launches")
        print("  " + " ".join(f"{s['busy']:.2f}/{s['graph_launches']}" for s in result["slices"]))
        print("kernels (ms, calls):")
        for k in result["kernels"][:40]:
            print(f"  {k['ms']:9.3f} {k['calls']:7d}  {k['name'][:100]}")
    else:
        result.update(batch=args.batch, steps=args.steps)
        per_step = {k: result[k] / args.steps / 1e3 for k in ("window_us", "busy_us", "idle_us")}
        print(f"{args.model} batch {args.batch}, {args.steps} decode steps under the profiler: "
              f"{per_step['window_us']:.3f} ms/step, GPU busy {per_step['busy_us']:.3f}, "
              f"idle {per_step['idle_us']:.3f}")  # fmt: skip
    print("gaps:", json.dumps(result["gaps"]))
    for g in result["largest"]:
        print(f"  {g['gap_us']:8.1f} us  " + ", ".join(f"{n} ({us})" for n, us in g["host"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
