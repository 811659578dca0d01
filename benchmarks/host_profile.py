"""Where the host time of a decode step goes, on the GPU: cProfile of the engine's step loop.

Runs decode steps of a named shape (random weights) at the given batch sizes, greedy, 128-token
prompts; prints the wall and GPU-kernel ms per step (bench.profile_decode: their difference is
host time the GPU waits for) and cProfile's top functions by own time, per step.

    PYTHONPATH=src python3 benchmarks/host_profile.py llama-3.2-1b 1,64
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys

import torch

from llm_inference import LLM, SamplingParams
from llm_inference.entrypoints.bench import VOCAB, profile_decode, random_checkpoint


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,64").split(",")]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    folder = random_checkpoint(shape)
    with LLM(str(folder), dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.85) as llm:
        for bs in batches:
            prof = profile_decode(llm, bs)
            print(f"\n## {shape} batch {bs}: wall {prof['wall_ms_per_step']:.3f} ms/step, "
                  f"GPU kernels {prof['gpu_ms_per_step']:.3f} ms/step")  # fmt: skip
            rng = random.Random(1)
            prompts = [[rng.randrange(VOCAB - 256) for _ in range(128)] for _ in range(bs)]
            sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            llm.generate(prompts, sp, use_tqdm=False)
            steps0 = llm.stats()["num_steps"]
            pr = cProfile.Profile()
            pr.enable()
            llm.generate(prompts, sp, use_tqdm=False)
            torch.cuda.synchronize()
            pr.disable()
            steps = llm.stats()["num_steps"] - steps0
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(top)
            print(f"(cProfile over {steps} steps; times are totals, divide by {steps})")
            print(s.getvalue()[-12000:])


if __name__ == "__main__":
    main()
