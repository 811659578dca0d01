"""Decode speed on the CPU: the default model (SmolLM2-135M-Instruct) through the reference
kernels, against HF transformers' `generate` on the same weights, in one process.

The CPU is where the README's main job runs without a GPU. Per dtype (float32, the CPU
default, and bfloat16) and batch size: `--max-tokens` greedy tokens of one prompt repeated
(ignore_eos), wall seconds over the whole `generate` after a warm-up, reported as ms per step
(a step decodes one token for every sequence) and output tokens per second; then transformers
(float32 and bfloat16, batch 1, `min_new_tokens` = `max_new_tokens`). The floor at batch 1 is
the weights' bytes over the machine's read bandwidth, printed from a GEMV of the LM head's shape.

    PYTHONPATH=src python3 benchmarks/cpu_decode.py [--batches 1,8,32] [--max-tokens 128]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time


def gemv_bandwidth(dtype, rows: int, cols: int) -> float:
    """GB/s of x @ W.T for one row (the decode matmul's shape), median of 20."""
    import torch

    w, x = torch.randn(rows, cols, dtype=dtype), torch.randn(1, cols, dtype=dtype)
    for _ in range(3):
        x @ w.T
    times = []
    for _ in range(20):
        t = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - t)
    times.sort()
    return w.numel() * w.element_size() / times[10] / 1e9


def ours(dtype: str, batches: list[int], max_tokens: int, prompt: str) -> dict:
    from llm_inference import LLM, SamplingParams

    out = {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(dtype=dtype) as llm:
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        for b in batches:
            t = time.perf_counter()
            llm.generate([prompt] * b, params, use_tqdm=False)
            s = time.perf_counter() - t
            out[b] = {"s": s, "ms_per_step": 1000 * s / max_tokens, "tok_s": b * max_tokens / s}
    return out


def transformers_bs1(dtype: str, max_tokens: int, prompt: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_inference.models.default_model import ensure_default_model

    folder = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    ids = tok([prompt], return_tensors="pt")
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    model.generate(**ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    t = time.perf_counter()
    model.generate(**ids, **kw)
    s = time.perf_counter() - t
    return {"s": s, "ms_per_step": 1000 * s / max_tokens, "tok_s": max_tokens / s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    batches = [int(b) for b in args.batches.split(",")]
    prompt = "Tell me a story about a dragon"
    result = {"cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "max_tokens": args.max_tokens, "gemv_GBps": {}, "ours": {},
              "transformers": {}}  # fmt: skip
    # 49,152 x 576: SmolLM2-135M's (tied) LM head
    for dtype in ("float32", "bfloat16"):
        result["gemv_GBps"][dtype] = gemv_bandwidth(getattr(torch, dtype), 49152, 576)
        result["ours"][dtype] = ours(dtype, batches, args.max_tokens, prompt)
        result["transformers"][dtype] = transformers_bs1(dtype, args.max_tokens, prompt)
    weights = 134_515_008  # SmolLM2-135M's parameters (the LM head tied)
    print(f"CPU: {result['cpu']}, {result['threads']} threads, torch {result['torch']}")
    print("| dtype | GEMV GB/s | floor ms (bs1) | ours bs1 ms | transformers bs1 ms | "
          + " | ".join(f"ours bs{b} ms (tok/s)" for b in batches[1:]) + " |")  # fmt: skip
    print("|---" * (5 + len(batches) - 1) + "|")
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        o, gbps = result["ours"][dtype], result["gemv_GBps"][dtype]
        floor = weights * size / gbps / 1e6
        cells = [f"{o[b]['ms_per_step']:.1f} ({o[b]['tok_s']:.0f})" for b in batches[1:]]
        hf = result["transformers"][dtype]["ms_per_step"]
        print(f"| {dtype} | {gbps:.1f} | {floor:.1f} | {o[batches[0]]['ms_per_step']:.1f} | "
              f"{hf:.1f} | " + " | ".join(cells) + " |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
