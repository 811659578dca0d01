"""Host time per decode step, on any machine: the engine's own work with the model taken out.

The tiny random checkpoint of the tests runs on the CPU with its forward pass replaced by a
stub that returns zeros (the LM head and the sampler still run, on a 320-token vocabulary), so
what a step costs is the scheduler, the SchedulerOutput diff, the worker's input batch, the
sampling metadata, update_from_output and the output processor: the part of a GPU step that
async scheduling must hide, and that NOTES.md counts per request. Decode steps at batch
1 / 64 / 256 (16-token prompts, 200 new tokens, temperature 0.6, final outputs only as
`LLM.generate` asks), median over 5 runs of the mean ms per step.

`--throughput` runs `bench throughput`'s workload (256 requests, in/out lengths uniform in
[100, 1024], temperature 0.6, seeded; prompt ids folded into the small vocabulary) through the
stub with async scheduling, and counts its steps: how many carry prompt tokens (mixed) and
how many only decode, the decode batch sizes, and the host's ms per step of each kind. Against
the GPU's measured throughput run, this says how many steps the run has and what the host
costs per step where async scheduling cannot hide it.

`--phases` instead splits the host's step at batch 64 and 256 (greedy, no detokenization, one
step at a time) into the scheduler's `schedule` (with the SchedulerOutput) and
`update_from_output`, the worker's `apply` and `prepare` (the input batch), the rest of
`execute_model` (here the stub, the LM head and the sampler on the CPU: on a GPU, copies and
launches instead) and the output processor, ms per step, medians of 3 runs after one.

    PYTHONPATH=src:tests python3 benchmarks/host_step.py [--phases | --throughput]
"""

from __future__ import annotations

import pickle
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


def _timed(obj, name: str, key: str, totals: dict) -> None:
    """Wrap obj.name so that its seconds add up in totals[key]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(obj, name, wrapper)


def pickle_us(obj, rounds: int = 1000) -> float:
    """Microseconds to pickle and unpickle `obj` (what a tensor-parallel step's
    SchedulerOutput costs the parent and each worker), median of 5."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        times.append((time.perf_counter() - start) / rounds * 1e6)
    return statistics.median(times)


def phases(folder: Path) -> None:
    print("| batch | schedule | apply | prepare | rest of execute | update | outputs | step "
          "| pickle us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in (64, 256):
        with LLM(str(folder), device="cpu", max_num_seqs=256, async_scheduling=False) as llm:
            runner = llm.engine.executor.workers[0].model_runner
            stub_forward(runner)
            core, totals = llm.engine.core, {}
            _timed(core.scheduler, "schedule", "schedule", totals)
            _timed(core.scheduler, "update_from_output", "update", totals)
            _timed(core.executor, "execute_model", "execute", totals)
            _timed(runner.input_batch, "apply", "apply", totals)
            _timed(runner.input_batch, "prepare", "prepare", totals)
            _timed(llm.engine.output_processor, "process_outputs", "outputs", totals)
            decode = []  # the SchedulerOutputs of decode steps (every request cached)
            schedule = core.scheduler.schedule

            def keep(schedule=schedule, decode=decode, batch=batch):
                so = schedule()
                if len(so.num_scheduled_tokens) == batch and not so.new_requests:
                    decode[:] = [so]
                return so

            core.scheduler.schedule = keep
            prompts = [[5 + (i * 7) % 300] * 16 for i in range(batch)]
            params = SamplingParams(
                temperature=0.0, max_tokens=200, ignore_eos=True, detokenize=False
            )
            runs = []
            for _ in range(4):
                totals.clear()
                before = llm.stats()["num_steps"]
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                steps = llm.stats()["num_steps"] - before
                run = {k: v / steps * 1e3 for k, v in totals.items()}
                run["execute"] -= run["apply"] + run["prepare"]
                run["step"] = (time.perf_counter() - start) / steps * 1e3
                runs.append(run)
        keys = ("schedule", "apply", "prepare", "execute", "update", "outputs", "step")
        cells = [statistics.median(r[k] for r in runs[1:]) for k in keys] + [pickle_us(decode[0])]
        print(f"| {batch} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


def throughput_steps() -> None:
    from llm_inference.entrypoints.bench import throughput_workload

    folder = make_checkpoint(Path(tempfile.mkdtemp()), max_position_embeddings=2048)
    prompts, params = throughput_workload(ids=300)
    with LLM(str(folder), device="cpu", max_num_seqs=256, max_model_len=2048) as llm:
        stub_forward(llm.engine.executor.workers[0].model_runner)
        core = llm.engine.core
        steps = []  # (prompt tokens, decode rows, host seconds from this schedule to the next)
        schedule = core.scheduler.schedule

        def record():
            so = schedule()
            now = time.perf_counter()
            if steps:
                steps[-1][2] = now - steps[-1][2]
            decodes = sum(1 for n in so.num_scheduled_tokens.values() if n == 1)
            prompt = so.total_num_scheduled_tokens - decodes
            steps.append([prompt, decodes, now])
            return so

        core.scheduler.schedule = record
        llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
        steps.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    steps = [s for s in steps[:-1] if s[0] or s[1]]  # the last one's time is open
    mixed = [s for s in steps if s[0]]
    decode = [s for s in steps if not s[0]]
    print(f"{len(steps)} steps in {wall:.2f} s: {len(mixed)} with prompt tokens "
          f"({sum(s[0] for s in mixed):,} prompt tokens, {sum(s[1] for s in mixed):,} decodes "
          f"among them), {len(decode)} decode-only")  # fmt: skip
    print("| steps | count | mean batch (decodes) | host ms/step (median) |")
    print("|---|---|---|---|")
    for name, group in (("with prompt tokens", mixed), ("decode only", decode)):
        if group:
            batch = statistics.mean(s[1] for s in group)
            host = statistics.median(s[2] for s in group) * 1e3
            print(f"| {name} | {len(group)} | {batch:.1f} | {host:.3f} |")
    for lo, hi in ((129, 256), (65, 128), (17, 64), (1, 16)):
        n = sum(1 for s in decode if lo <= s[1] <= hi)
        print(f"decode-only steps with {lo}-{hi} rows: {n}")


def main() -> None:
    torch.set_num_threads(1)
    if "--throughput" in sys.argv[1:]:
        throughput_steps()
        return
    folder = make_checkpoint(Path(tempfile.mkdtemp()), max_position_embeddings=512)
    if "--phases" in sys.argv[1:]:
        phases(folder)
        return
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
