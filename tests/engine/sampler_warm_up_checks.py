"""Child script of test_sampler_warm_up_variants.py, run with TRITON_INTERPRET=1: does the
engine's sampler warm-up launch the sampling kernels with every variant that requests launch
them with, a batch of structured, seeded, greedy and logprobs requests, and batches whose rows
filter by top-p, or top-k and top-p?

A variant is what Triton compiles a kernel for: the constexprs (passed by keyword here), each
tensor argument's dtype and whether its address is a multiple of 16 bytes, each other integer
argument's being 1 and being a multiple of 16, except those the kernel does not specialize
(`variant`). The CPU engine runs the reference kernels, so the Triton sampler is put on its ops
(under the interpreter), the model runner's `_warm_up_sampler` (a CUDA engine's start) is
called by hand, and every launch of the three kernels is recorded, first the warm-up's, then
the requests'. On CUDA, test_triton_engine.py's compile-nothing tests see the same as
compiles; this runs on any machine.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from interpreter import report_each  # noqa: E402

KERNELS = ("_split_race_kernel", "_merge_kernel", "_sample_kernel")


def variant(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles `kernel` (an interpreted one) for, given a launch's arguments."""
    skip = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, arg in zip(kernel.arg_names, args):
        if name in skip:
            continue
        if isinstance(arg, torch.Tensor):
            key.append((name, arg.dtype, arg.data_ptr() % 16 == 0))
        elif isinstance(arg, int):
            key.append((name, arg == 1, arg % 16 == 0))
    return (kernel.fn.__name__, *key, *sorted(kwargs.items()))


def check_covered(_) -> None:
    from helpers import make_checkpoint

    from llm_inference import LLM, SamplingParams
    from llm_inference import StructuredOutputsParams as S
    from llm_inference.kernels import reference, sampling

    reference.ReferenceOps.fused_sampler = True
    reference.ReferenceOps.sample = staticmethod(sampling.sample)
    reference.ReferenceOps.warm_up_sampler = staticmethod(sampling.warm_up)
    seen: dict[str, set] = {"warm-up": set(), "requests": set()}
    phase = ["warm-up"]
    for name in KERNELS:
        kernel = getattr(sampling, name)

        def run(*args, grid, warmup, kernel=kernel, launch=kernel.run, **kwargs):
            seen[phase[0]].add(variant(kernel, args, kwargs))
            return launch(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = run
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"]}  # fmt: skip
    specs = [S(json=schema, disable_any_whitespace=True), S(regex=r"[a-c]{2,4}\d"), None]
    prompts = ["The quick brown", "Paris is the capital", "Hello world! How are", "One two"]
    folder = make_checkpoint(Path(tempfile.mkdtemp()))
    with LLM(str(folder), device="cpu", dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
             max_num_seqs=8) as llm:  # fmt: skip
        llm.engine.executor.workers[0].model_runner._warm_up_sampler()
        phase[0] = "requests"
        params = [SamplingParams(temperature=0.0 if i % 4 == 3 else 1.0, seed=i, max_tokens=12,
                                 structured_outputs=specs[i % 3],
                                 logprobs=2 if i % 5 == 4 else None)
                  for i in range(12)]  # fmt: skip
        llm.generate((prompts * 3)[:12], params, use_tqdm=False)
        for filters in (dict(top_p=0.9), dict(top_k=5, top_p=0.9)):
            params = [SamplingParams(temperature=0.0 if i % 3 == 2 else 1.0, seed=i,
                                     max_tokens=6, **filters)
                      for i in range(6)]  # fmt: skip
            llm.generate((prompts * 2)[:6], params, use_tqdm=False)
    new = seen["requests"] - seen["warm-up"]
    assert seen["requests"] and not new, f"variants the warm-up did not launch: {new}"


if __name__ == "__main__":
    report_each(["covered"], lambda name: check_covered(name))
