"""Cyclic-GC pauses inside `LLM.generate` (CPU, the model's forward stubbed to zeros, so that a
step is the engine's own host work and the LM head and sampler on a tiny vocabulary):
256 prompts of 128 tokens, 8 and 136 new tokens, three runs each; per run the wall time, the
collections of each generation and how long each full (generation 2) collection took, timed
with `gc.callbacks`. Shows what freezing the startup heap (gc_heap.py) changes.

    PYTHONPATH=src python3 benchmarks/gc_pauses.py
"""

from __future__ import annotations

import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers  # noqa: F401  (bench.py imports it too: part of the startup heap)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import make_checkpoint  # noqa: E402

from llm_inference import LLM, SamplingParams  # noqa: E402


def stub_forward(runner) -> None:
    """The model's forward -> zeros (the LM head and the sampler still run)."""
    hidden = runner.model.config.hidden_size
    runner._forward = lambda step: torch.zeros(step.num_tokens, hidden)


def main() -> None:
    torch.set_num_threads(1)
    folder = make_checkpoint(Path(tempfile.mkdtemp()), max_position_embeddings=512)
    started, log = {}, []

    def timer(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            log.append((info["generation"], (time.perf_counter() - started["t"]) * 1e3))

    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(128)] for _ in range(256)]
    with LLM(str(folder), device="cpu", max_model_len=512, enable_prefix_caching=False) as llm:
        stub_forward(llm.engine.executor.workers[0].model_runner)
        print(f"objects the GC scans: {len(gc.get_objects())}, frozen: {gc.get_freeze_count()}")
        print("| new tokens | run | ms | collections gen 0/1/2 | each gen-2 ms |")
        print("|---|---|---|---|---|")
        for n in (8, 136):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            for run in range(3):
                gc.callbacks.append(timer)
                log.clear()
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                ms = (time.perf_counter() - t) * 1e3
                gc.callbacks.remove(timer)
                counts = "/".join(str(sum(1 for g, _ in log if g == k)) for k in range(3))
                full = ", ".join(f"{d:.1f}" for g, d in log if g == 2) or "-"
                print(f"| {n} | {run} | {ms:.0f} | {counts} | {full} |")


if __name__ == "__main__":
    main()
