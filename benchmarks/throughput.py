"""Offline throughput: nano-vllm's benchmark, the workload of `../shared/vllm/vllm_bench.py`.

256 requests, prompt and output lengths uniform in [100, 1024] (random token ids), temperature
0.6, ignore_eos; random weights in the Llama-3.2-1B (or 3B) shape, bf16, max_model_len 4096.
Prints output tokens per second of the whole batch (one warm-up batch of 8 first).

    PYTHONPATH=src python3 benchmarks/throughput.py [--shape 1b] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from e2e_latency import make_checkpoint  # noqa: E402


def workload(n: int = 256, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    max_tokens = [rng.randint(100, 1024) for _ in range(n)]
    return prompts, max_tokens


def main() -> None:
    from llm_inference import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts, max_tokens = workload(args.num_requests)
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, seed=i)
        for i, m in enumerate(max_tokens)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(args.shape, Path(tmp))
        t = time.perf_counter()
        with LLM(
            str(folder), dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.85
        ) as llm:
            startup = time.perf_counter() - t
            llm.generate(prompts[:8], params[:8], use_tqdm=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            stats = llm.stats()
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(map(len, prompts))
    assert n_out == sum(max_tokens)
    lines = [
        f"# Throughput, {datetime.date.today()}, {torch.cuda.get_device_name()}",
        "",
        f"Command: `PYTHONPATH=src python3 benchmarks/throughput.py --shape {args.shape}`",
        f"{args.num_requests} requests, in/out lengths uniform in [100, 1024], temperature 0.6,"
        " ignore_eos, bf16, random weights, max_model_len 4096, gpu_memory_utilization 0.85.",
        "",
        "| shape | startup s | time s | output tok/s | total tok/s | output tokens |"
        " steps | preemptions | KV blocks |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {args.shape} | {startup:.1f} | {dt:.2f} | {n_out / dt:,.0f} | "
        f"{(n_in + n_out) / dt:,.0f} | {n_out:,} | {stats['num_steps']} | "
        f"{stats['num_preemptions']} | {stats['num_kv_blocks']} |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
