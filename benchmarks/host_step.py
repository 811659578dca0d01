"""Host time per decode step, on any machine: the engine's own work with the model taken out.

The tiny random checkpoint of the tests runs on the CPU with its forward pass replaced by a
stub that returns zeros (the LM head and the sampler still run, on a 320-token vocabulary), so
what a step costs is the scheduler, the SchedulerOutput diff, the worker's input batch, the
sampling metadata, update_from_output and the output processor: the part of a GPU step that
async scheduling must hide, and that NOTES.md counts per request. Decode steps at batch
1 / 64 / 256 (16-token prompts, 200 new tokens, temperature 0.6, final outputs only as
`LLM.generate` asks), median over 5 runs of the mean ms per step.

    PYTHONPATH=src:tests python3 benchmarks/host_step.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import make_checkpoint  # noqa: E402

from llm_inference import LLM, SamplingParams  # noqa: E402


def stub_forward(runner):
    hidden = runner.model.config.hidden_size

    def forward(step):
        return torch.zeros(step.num_tokens, hidden)

    runner._forward = forward


def ms_per_step(llm, batch: int, new_tokens: int = 200) -> float:
    prompts = [[5 + (i * 7) % 300] * 16 for i in range(batch)]
    params = SamplingParams(temperature=0.6, max_tokens=new_tokens, ignore_eos=True, seed=1)
    runs = []
    for _ in range(6):
        before = llm.stats()["num_steps"]
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        runs.append((time.perf_counter() - t) / (llm.stats()["num_steps"] - before) * 1e3)
    return statistics.median(runs[1:])


def main() -> None:
    torch.set_num_threads(1)
    folder = make_checkpoint(Path(tempfile.mkdtemp()), max_position_embeddings=512)
    print("| mode | batch 1 | batch 64 | batch 256 |")
    print("|---|---|---|---|")
    for mode in (True, False):
        with LLM(str(folder), device="cpu", max_num_seqs=256, async_scheduling=mode) as llm:
            stub_forward(llm.engine.executor.workers[0].model_runner)
            row = [ms_per_step(llm, b) for b in (1, 64, 256)]
        name = "async" if mode else "sync"
        print(f"| {name} | " + " | ".join(f"{ms:.3f}" for ms in row) + " |", flush=True)


if __name__ == "__main__":
    main()
