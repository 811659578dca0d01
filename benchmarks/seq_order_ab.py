"""The engine's throughput with decode attention programs dispatched longest context first
(`seq_order`, from kernels/unified_attention.py's ORDER_MIN_SEQS sequences) against batch
order: one process, one model, the `bench throughput` workload (256 requests, in/out uniform in
[100, 1024]), the two settings alternating, a fixed KV cache so that both schedule alike.

    PYTHONPATH=src python benchmarks/seq_order_ab.py [--model llama-3.2-3b] [--rounds 1]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from llm_inference import LLM
from llm_inference.entrypoints.bench import random_checkpoint, throughput
from llm_inference.kernels import unified_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-3b")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--kv-gib", type=int, default=48)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    folder = random_checkpoint(args.model)
    default = unified_attention.ORDER_MIN_SEQS
    rows = []
    print(f"{args.model}, {torch.cuda.get_device_name()}, KV cache {args.kv_gib} GiB")
    print("| round | order | out tok/s | s |\n|---:|---|---:|---:|")
    for r in range(args.rounds):
        for name, min_seqs in (("batch", 10**9), ("longest first", default)):
            unified_attention.ORDER_MIN_SEQS = min_seqs  # read at each launch (graph capture)
            with LLM(str(folder), dtype="bfloat16", max_model_len=4096,
                     kv_cache_memory_bytes=args.kv_gib << 30, enable_prefix_caching=False,
                     max_num_seqs=256) as llm:  # fmt: skip
                res = throughput(llm)
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(dict(round=r, order=name, **res))
            print(f"| {r} | {name} | {res['output_tok_per_s']:,.0f} | {res['seconds']:.2f} |",
                  flush=True)  # fmt: skip
    unified_attention.ORDER_MIN_SEQS = default
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
