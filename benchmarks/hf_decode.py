"""Hugging Face transformers' decode ms per step, the workload of `llm-inference bench latency`
(and of ../shared/vllm/vllm_bench.py): 128-token random prompts, greedy, ignore EOS, ms per step
= (time of 136 new tokens - time of 8) / 128, batch 1 / 8 / 64 / 256. `generate` in bf16 with
its defaults (dynamic cache, the default attention). One warm-up, then the median of 3 runs of
each length (1 at batch 256, where a run takes seconds).

    PYTHONPATH=src python3 benchmarks/hf_decode.py llama-3.2-1b [OUT.json]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from llm_inference.entrypoints.bench import BATCHES, VOCAB, random_checkpoint


def main() -> None:
    shape = sys.argv[1]
    folder = random_checkpoint(shape)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    rng = random.Random(0)
    res = {"shape": shape, "engine": "transformers", "decode_ms_per_step": {}}
    for bs in BATCHES:
        ids = torch.tensor(
            [[rng.randrange(VOCAB - 256) for _ in range(128)] for _ in range(bs)], device="cuda"
        )

        def run(n: int, ids: torch.Tensor = ids) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            torch.cuda.synchronize()
            return time.perf_counter() - t

        run(8)
        reps = 1 if bs >= 256 else 3
        short = statistics.median(run(8) for _ in range(reps))
        long = statistics.median(run(136) for _ in range(reps))
        res["decode_ms_per_step"][bs] = round((long - short) / 128 * 1e3, 3)
        print(f"transformers {shape} bs{bs}: {res['decode_ms_per_step'][bs]} ms/step", flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
