"""GPU time of sampling one token per row with top-p, top-k and min-p against a plain
(temperature-only) row: this engine's fused sampler (kernels/sampling.py) and, where vLLM is
importable, vLLM's PyTorch path (temperature, `apply_top_k_top_p`, softmax, `random_sample`).
bfloat16 logits [B, 128,256] as the LM head gives them, temperature 0.8; two kinds of rows:
"flat" (standard normal logits, as random weights give: top-p 0.95 keeps most of the
vocabulary) and "peaked" (normal logits times 4, closer to a trained model's). Each call
replayed from a CUDA graph where it captures (triton's do_bench_cudagraph, median), else timed
eagerly (do_bench); the column says which. Run with PYTHONPATH on two trees to compare kernels.

    PYTHONPATH=src python3 benchmarks/sampler_filters.py [--batches 1,8,64,256] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing

from llm_inference.kernels import sampling

V = 128_256
TEMPERATURE = 0.8
FILTERS = {  # name: (top_k, top_p, min_p); None: off
    "plain": (None, None, None),
    "top_p 0.95": (None, 0.95, None),
    "top_k 50": (50, None, None),
    "top_k 50 + top_p 0.95": (50, 0.95, None),
    "min_p 0.05": (None, None, 0.05),
}
SCALES = {"flat": 1.0, "peaked": 4.0}


def vllm_sampler():
    """vLLM's PyTorch sampling path as a function of (logits, k, p), or None without vLLM."""
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p, random_sample
    except ImportError:
        return None

    def run(logits, temperature, k, p):
        x = logits.float().div_(temperature[:, None])
        x = apply_top_k_top_p(x, k, p)
        return random_sample(x.softmax(dim=-1, dtype=torch.float32), {})

    return run


def timed(fn) -> tuple[float, str]:
    """Median microseconds per call: in a CUDA graph where fn captures, else eager."""
    fn()  # compile outside the graph
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3, "graph"
    except Exception:  # not capturable (a host sync): time it as launched
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=200, return_mode="median") * 1e3, "eager"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    vllm = vllm_sampler()
    rows = []
    print("| rows | batch | filter | ours us | vLLM us | ours: how timed | vLLM: how timed |")
    print("|---|---:|---|---:|---:|---|---|")
    for kind, scale in SCALES.items():
        for b in [int(x) for x in args.batches.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(b)
            logits = (torch.randn(b, V, device="cuda", generator=gen) * scale).bfloat16()
            keys = torch.randint(0, 2**31, (b,), device="cuda", generator=gen, dtype=torch.int32)
            temp = torch.full((b,), TEMPERATURE, device="cuda")
            for name, (k, tp, mp) in FILTERS.items():
                top_k, top_p, min_p = (
                    None if x is None else torch.full((b,), x, device="cuda", dtype=dtype)
                    for x, dtype in ((k, torch.int32), (tp, torch.float32), (mp, torch.float32))
                )
                ours = functools.partial(
                    sampling.sample, logits, keys, temp, top_k=top_k, top_p=top_p, min_p=min_p
                )
                row = {"rows": kind, "batch": b, "filter": name}
                row["ours_us"], row["ours_timed"] = timed(ours)
                if vllm is not None and mp is None:  # vLLM applies min-p elsewhere
                    k64 = None if top_k is None else top_k.long()
                    row["vllm_us"], row["vllm_timed"] = timed(
                        functools.partial(vllm, logits, temp, k64, top_p)
                    )
                rows.append(row)
                v = f"{row['vllm_us']:.1f}" if "vllm_us" in row else "-"
                how = f"{row['ours_timed']} | {row.get('vllm_timed', '-')}"
                print(f"| {kind} | {b} | {name} | {row['ours_us']:.1f} | {v} | {how} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
