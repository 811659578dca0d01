"""The default model on the CPU with torch's threads against one thread, on an idle machine and
on one where another CPU-bound process runs per core: seconds to generate 32 greedy tokens for
each of 2 prompts (3 runs after a warm-up), each setting in a fresh process.

    PYTHONPATH=src python3 benchmarks/cpu_threads.py
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

RUN = """
import sys, time, torch
if int(sys.argv[1]):
    torch.set_num_threads(int(sys.argv[1]))
from llm_inference import LLM, SamplingParams
with LLM() as llm:
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(["Hello"], p, use_tqdm=False)
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(["Hello there", "The capital of France"], p, use_tqdm=False)
        print(round(time.perf_counter() - t, 2))
"""


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run(threads: int) -> list[float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", RUN, str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    cores = os.cpu_count() or 1
    print(f"| machine ({cores} cores) | threads | seconds per run (2 x 32 tokens) |")
    print("|---|---|---|")
    for load in (False, True):
        procs = [multiprocessing.Process(target=busy, args=(120,)) for _ in range(cores * load)]
        for p in procs:
            p.start()
        try:
            for threads in (0, 1):
                label = f"torch's default ({cores})" if threads == 0 else "1"
                where = "busy (a CPU-bound process per core)" if load else "idle"
                print(f"| {where} | {label} | {', '.join(map(str, run(threads)))} |", flush=True)
        finally:
            for p in procs:
                p.terminate()
                p.join()


if __name__ == "__main__":
    main()
