"""vLLM's offline `LLM.generate` on the requests `llm-inference bench throughput` sends.

The same dataset, seed and sampling options (bench_datasets.py, through bench's own
`throughput_requests`: the same prompt ids and max_tokens), each request seeded with its index
with `--seed-requests` (ours seeds every request with its index, at no cost; vLLM draws a seeded
request's noise row by row in `random_sample`, a cost users who do not seed never pay, so by
default its requests go unseeded); a warm-up on the first 8, then all of them in one timed call;
the results under bench throughput's `--json` keys, plus `vllm` (its version). `--latency`, for
the shapes ../shared/vllm/vllm_bench.py does not know, first measures vLLM's decode ms per step
at `--batches` as vllm_bench.py does (the prompts `bench latency` draws, 128 random ids each;
medians of 3 greedy runs of 136 and of 8 tokens, their difference over 128 steps) under its JSON
keys `decode_ms_per_step_bsN`, then runs the throughput workload in the same vLLM process (one
start: an 8B model's takes 60-90 s). vLLM starts as
../shared/vllm/vllm_bench.py starts it: the random-weight checkpoint of a named shape (bench's
`random_checkpoint`, the one our bench loads), no tokenizer, token ids only, bench's defaults
where bench has its own (`--max-model-len`, prefix caching off unless
`--enable-prefix-caching`), vLLM's otherwise. Run where vLLM is installed, from the repository
root:

    PYTHONPATH=src python3 benchmarks/vllm_throughput.py --model llama-3.2-1b --dataset lognormal
    PYTHONPATH=src python3 benchmarks/vllm_throughput.py --model qwen3-8b --latency --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from llm_inference.entrypoints import bench
from llm_inference.entrypoints.bench_datasets import Workload, add_workload_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = ", ".join(bench.SHAPES)
    p.add_argument("--model", default="llama-3.2-1b",
                   help=f"a checkpoint folder or a named shape ({shapes})")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=256, help="requests")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (bench's --seed)")
    add_workload_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs")
    p.add_argument("--max-model-len", type=int, default=4096, help="as bench's default")
    p.add_argument("--enable-prefix-caching", action="store_true", help="off, as in bench")
    p.add_argument("--max-num-seqs", type=int, default=256, help="as bench's default")
    p.add_argument("--seed-requests", action="store_true",
                   help="seed request i with i, as ours (default: unseeded)")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: vLLM's)")  # fmt: skip
    p.add_argument("--quantization", default=None, help="vLLM's option: fp8 (default: none)")
    p.add_argument("--kv-cache-dtype", default=None, help="vLLM's option: fp8 (default: auto)")
    p.add_argument("--latency", action="store_true",
                   help="first decode ms per step at --batches, as vllm_bench.py")  # fmt: skip
    p.add_argument("--batches", type=batch_sizes, default=list(bench.BATCHES),
                   help="--latency's batch sizes (default: 1,8,64,256)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="then the workload again under the torch profiler: GPU kernel seconds by "
                        "kernel, as `bench throughput --profile` reports ours (vLLM's engine "
                        "core runs in this process then)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def batch_sizes(text: str) -> list[int]:
    """`--batches`: comma-separated positive integers."""
    sizes = [int(b) for b in text.split(",")]
    if min(sizes) < 1:
        raise ValueError(text)
    return sizes


def latency_prompts(vocab: int, batches: list[int], seed: int = 0) -> dict[int, list[list[int]]]:
    """Each batch size's 128-token prompts: those `bench latency` draws (one generator over the
    batch sizes in turn, ids below the vocabulary's last 256; vllm_bench.py's for Llama 3)."""
    rng = random.Random(seed)
    return {bs: [[rng.randrange(vocab - 256) for _ in range(128)] for _ in range(bs)]
            for bs in batches}  # fmt: skip


def build_requests(args, folder) -> tuple[Workload, list[list[int]], list[dict]]:
    """The workload, its prompt ids and each request's vLLM `SamplingParams` arguments: those
    of `bench throughput` with the same options."""
    workload = Workload.from_args(args)
    prompts, params = bench.throughput_requests(workload, args.model, folder)
    kwargs = [dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                   max_tokens=p.max_tokens, ignore_eos=True, detokenize=False,
                   seed=p.seed if args.seed_requests else None)
              for p in params]  # fmt: skip
    return workload, prompts, kwargs


def profile_run(timed, n: int, device: str = "cuda") -> dict:
    """`timed(n)` under our profiler (executor/profiler.py, the one `bench throughput --profile`
    runs on ours): its wall seconds and the GPU kernel seconds in all and by kernel, under
    bench's JSON keys (`_per_step` over 1,000 "steps": milliseconds become seconds)."""
    import torch

    from llm_inference.executor.profiler import RankProfiler

    profiler = RankProfiler(0, torch.device(device))
    profiler.start()
    try:
        wall = timed(n)
    finally:
        rank = profiler.stop()
    return {"wall_s": wall, "ranks": [bench._per_step(rank, bench._NO_PROFILE, 1000)]}


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    model = args.model
    try:
        Workload.from_args(args)  # a bad option stops here, before a checkpoint is written
        folder = bench.random_checkpoint(model) if model in bench.SHAPES else Path(model)
        workload, prompts, kwargs = build_requests(args, folder)
    except ValueError as e:
        parser.error(str(e))
    import torch

    if args.profile:  # the profiler sees this process's kernels only
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm

    extra = {"max_num_batched_tokens": args.max_num_batched_tokens,
             "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}  # fmt: skip
    llm = vllm.LLM(str(folder), skip_tokenizer_init=True, max_model_len=args.max_model_len,
                   gpu_memory_utilization=0.85, max_num_seqs=args.max_num_seqs,
                   enable_prefix_caching=args.enable_prefix_caching,
                   seed=0, tensor_parallel_size=args.tensor_parallel_size,
                   **{k: v for k, v in extra.items() if v is not None})  # fmt: skip
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    params = [vllm.SamplingParams(**kw) for kw in kwargs]

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(inputs[:n], params[:n], use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    res = {}
    if args.latency:
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        ms = decode_latency(llm, vllm, latency_prompts(vocab, args.batches))
        rows = {f"bs{bs}": {"ms_per_step": v} for bs, v in ms.items()}
        print(f"vLLM {vllm.__version__}, " + bench.format_result(
            {"model": model, "kind": "latency", **rows}))  # fmt: skip
        res = {f"decode_ms_per_step_bs{bs}": v for bs, v in ms.items()}
    timed(8)  # the warm-up, as bench throughput's
    dt = timed(len(inputs))
    n_in, n_out = sum(map(len, prompts)), sum(kw["max_tokens"] for kw in kwargs)
    res |= {
        "model": model, "kind": "throughput", "tp": args.tensor_parallel_size,
        "seconds": dt, "requests_per_s": len(prompts) / dt, "output_tok_per_s": n_out / dt,
        "total_tok_per_s": (n_in + n_out) / dt, "output_tokens": n_out,
        "workload": workload.describe(list(map(len, prompts)), [kw["max_tokens"] for kw in kwargs]),
        "detokenize": False, "vllm": vllm.__version__,
    } | {k: v for k, v in extra.items() if k != "max_num_batched_tokens" and v}  # fmt: skip
    print(f"vLLM {vllm.__version__}, " + bench.format_result(res))
    if args.profile:
        res["profile"] = profile_run(timed, len(inputs))
        top = res["profile"]["ranks"][0]["top_kernels_ms_per_step"]
        print("GPU kernel seconds:", {name[:60]: round(s, 3) for name, s in list(top.items())[:8]})
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


def decode_latency(llm, vllm, prompts: dict[int, list[list[int]]]) -> dict[int, float]:
    """vllm_bench.py's decode ms per step at each batch size: after two warm-ups of 8 tokens,
    the median of 3 greedy runs of 136 tokens less that of 8, over 128 steps."""
    import torch

    def timed(inputs, max_tokens: int) -> float:
        sp = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                 detokenize=False)  # fmt: skip
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    out = {}
    for bs, batch in prompts.items():
        inputs = [{"prompt_token_ids": ids} for ids in batch]
        for _ in range(2):
            timed(inputs, 8)
        short = statistics.median(timed(inputs, 8) for _ in range(3))
        long = statistics.median(timed(inputs, 136) for _ in range(3))
        out[bs] = round((long - short) / 128 * 1e3, 3)
    return out


if __name__ == "__main__":
    main()
