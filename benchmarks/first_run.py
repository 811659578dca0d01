"""The throughput run, several times in one engine: is the first one slower, and what compiles
during it?

`bench throughput` times one run of the 256-request workload after a warm-up on 8 requests,
as vLLM's benchmark does. If a kernel meets a new specialization during the timed run (Triton
compiles one per new constexpr or per integer argument newly equal to 1 or divisible by 16),
the compile lands in the measured seconds: the first run is slower than the ones after it, and
a user's first large batch pays it too. This prints, per run, its seconds and the Triton
compiles (in-memory cache misses) that happened during it: the kernel, how long the compile
took and the specialization that caused it. Run with a fresh TRITON_CACHE_DIR to see what a
new machine pays (the default cache on disk would hide the compile time, not the misses).

    PYTHONPATH=src TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/first_run.py \
        [--model llama-3.2-1b] [--runs 3] [--enforce-eager] [--json PATH]

With --enforce-eager no graph capture compiles the model's kernels at start: what the runs
compile is what an eager engine's steps meet for the first time.
"""

from __future__ import annotations

import argparse
import json
import time


class CompileLog:
    """Triton's JIT hooks: the kernel name, wall seconds and specialization of each compile."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._start: float | None = None

    def install(self) -> None:
        import triton

        triton.knobs.runtime.jit_cache_hook = self._before
        triton.knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *args, **kw):
        self._start = time.perf_counter()
        return None  # compile as usual

    def _after(self, *args, **kw):
        spent = time.perf_counter() - self._start if self._start is not None else 0.0
        self.events.append({"kernel": kw["fn"].name, "s": spent, "repr": kw["repr"]})
        self._start = None

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    from llm_inference import LLM
    from llm_inference.entrypoints.bench import (
        _timed_generate,
        random_checkpoint,
        throughput_workload,
    )

    log = CompileLog()
    log.install()
    folder = random_checkpoint(args.model)
    kw = dict(max_model_len=4096, gpu_memory_utilization=0.85, max_num_seqs=256,
              enforce_eager=args.enforce_eager)  # fmt: skip
    t = time.perf_counter()
    with LLM(str(folder), dtype="bfloat16", enable_prefix_caching=False, **kw) as llm:
        start = {"s": time.perf_counter() - t, "compiles": log.take()}
        prompts, params = throughput_workload(detokenize=False)
        _timed_generate(llm, prompts[:8], params[:8])  # bench throughput's warm-up
        warm = log.take()
        runs = []
        for _ in range(args.runs):
            runs.append({"s": _timed_generate(llm, prompts, params), "compiles": log.take()})
    out = {"model": args.model, "enforce_eager": args.enforce_eager,
           "device": torch.cuda.get_device_name(), "start": start, "warmup_compiles": warm,
           "runs": runs}  # fmt: skip
    n_out = sum(sp.max_tokens for sp in params)
    print(f"{args.model}: engine start {start['s']:.1f} s with {len(start['compiles'])} "
          f"compiles; warm-up on 8 requests: {len(warm)} compiles")  # fmt: skip
    for i, run in enumerate(runs):
        spent = sum(e["s"] for e in run["compiles"])
        print(f"run {i + 1}: {run['s']:.3f} s ({n_out / run['s']:,.0f} output tok/s), "
              f"{len(run['compiles'])} compiles taking {spent:.3f} s")  # fmt: skip
        for e in run["compiles"]:
            print(f"    {e['s']:.3f} s  {e['repr'][:160]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
