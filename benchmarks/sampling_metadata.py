"""CPU cost of SamplingMetadata.build with a repetition penalty: 256 requests, 4,096 prompt tokens
each, 128 output tokens each (the penalty pads every prompt and output each step).

Prints the median wall ms of `build` over 10 calls, and of the padding alone: the old per-row
Python padding (copied here) against `padded_token_ids`, interleaved in one process.

    PYTHONPATH=src python benchmarks/sampling_metadata.py
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from llm_inference.sample.metadata import SamplingMetadata, padded_token_ids
from llm_inference.sampling_params import SamplingParams

B, PROMPT, OUTPUT, V = 256, 4096, 128, 128_256


def padded_per_row(rows: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """The padding SamplingMetadata.build used before padded_token_ids."""
    width = max(1, max((len(r) for r in rows), default=0))
    data = [[t if 0 <= t < vocab_size else vocab_size for t in r] for r in rows]
    data = [r + [vocab_size] * (width - len(r)) for r in data]
    return torch.tensor(data, dtype=torch.int64, device=device)


def median_ms(fn, reps: int = 10) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(PROMPT)] for _ in range(B)]
    outputs = [[rng.randrange(V) for _ in range(OUTPUT)] for _ in range(B)]
    params = [SamplingParams(temperature=0.6, repetition_penalty=1.1)] * B
    seeds = list(range(B))

    def build():
        SamplingMetadata.build(params, prompts, outputs, seeds, (1,), V, "cpu")

    print(f"B={B} prompt={PROMPT} output={OUTPUT} V={V}")
    print(f"build with repetition_penalty: {median_ms(build):.1f} ms (median of 10)")
    old = median_ms(lambda: padded_per_row(prompts, V, "cpu"))
    new = median_ms(lambda: padded_token_ids(prompts, V, "cpu"))
    print(f"padding the prompts: per-row Python {old:.1f} ms, padded_token_ids {new:.1f} ms")


if __name__ == "__main__":
    main()
