"""Prefix caching on a shared system prompt: 64 requests, each a 2,000-token system prompt
followed by its own 100-token question, 32 new tokens each (greedy, ignore_eos), all submitted
at once; random weights in a Llama-3.2 shape, bf16. Time to first token of every request
(from submission to the step that returns its first token) and the whole batch's time, with
prefix caching on and off, in one process. After a warm-up on an unrelated prompt, the first
batch finds the cache cold (its own requests share the prefix once computed); three more
batches with new questions find the system prompt cached (median reported as "warm").

    PYTHONPATH=src python3 benchmarks/prefix_caching.py [--shape llama-3.2-1b] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from llm_inference import LLM, SamplingParams
from llm_inference.entrypoints.bench import random_checkpoint


def workload(questions_seed: int, n: int = 64, system: int = 2000, question: int = 100):
    prefix_rng, rng = random.Random(0), random.Random(questions_seed)
    prefix = [prefix_rng.randrange(10000) for _ in range(system)]
    return [prefix + [rng.randrange(10000) for _ in range(question)] for _ in range(n)]


def run_once(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    ttft = sorted(first.values())
    return {
        "total_s": total,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_max_s": ttft[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    folder = random_checkpoint(args.shape)
    results = {}
    rng = random.Random(99)
    unrelated = [[rng.randrange(10000) for _ in range(300)] for _ in range(4)]
    for caching in (False, True):
        name = "on" if caching else "off"
        with LLM(str(folder), dtype="bfloat16", max_model_len=4096,
                 gpu_memory_utilization=0.85, enable_prefix_caching=caching) as llm:  # fmt: skip
            run_once(llm, unrelated, 4)  # compile and capture outside the timings
            results[f"{name}_cold"] = run_once(llm, workload(1), args.new_tokens)
            warm = [run_once(llm, workload(2 + i), args.new_tokens) for i in range(3)]
            results[f"{name}_warm"] = {k: statistics.median(r[k] for r in warm) for k in warm[0]}
            results[f"{name}_stats"] = llm.stats()
        print(f"caching {name}: {results[name + '_cold']} {results[name + '_warm']}", flush=True)
    print("| caching | batch | total s | TTFT mean s | TTFT p50 s | TTFT max s |")
    print("|---|---|---|---|---|---|")
    for key in ("off_cold", "on_cold", "off_warm", "on_warm"):
        r = results[key]
        print(f"| {key.replace('_', ' | ')} | {r['total_s']:.3f} | {r['ttft_mean_s']:.3f} | "
              f"{r['ttft_p50_s']:.3f} | {r['ttft_max_s']:.3f} |")  # fmt: skip
    for kind in ("cold", "warm"):
        off, on = results[f"off_{kind}"], results[f"on_{kind}"]
        print(f"{kind}: caching on is {off['total_s'] / on['total_s']:.2f}x faster in total, "
              f"{off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x in mean TTFT")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
