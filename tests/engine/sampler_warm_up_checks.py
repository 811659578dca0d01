"""Child script of test_sampler_warm_up_variants.py, run with TRITON_INTERPRET=1: does the
engine's sampler warm-up launch the split race with every variant that a batch of structured,
seeded, greedy and logprobs requests launches it with?

A variant is what Triton compiles a kernel for: the constexprs, each tensor argument's dtype and
whether its address is a multiple of 16 bytes, each integer argument's being 1 and being a
multiple of 16 (`variant` here). The CPU engine runs the reference kernels, so the Triton
sampler is put on its ops (under the interpreter), the model runner's `_warm_up_sampler` (a
CUDA engine's start) is called by hand, and every `_split_race` launch is recorded, first the
warm-up's, then the requests'. On CUDA, test_triton_engine.py's compile-nothing test sees the
same as compiles; this runs on any machine.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from interpreter import report_each  # noqa: E402


def variant(logits, keys, temperature, greedy, dummy, splits: int, block: int, mask) -> tuple:
    from llm_inference.kernels import sampling

    def tensor(t):
        return t.dtype, t.data_ptr() % 16 == 0

    def integer(v: int):
        return v == 1, v % 16 == 0

    blocks = -(-logits.shape[1] // block)
    chunk = -(-blocks // splits) * block
    bitmask, rows, mask_stride = sampling._mask_args(mask, dummy)
    return (
        tensor(logits), integer(logits.stride(0)), tensor(keys), tensor(temperature),
        tensor(sampling._greedy_arg(greedy, dummy)), tensor(bitmask), tensor(rows),
        integer(mask_stride), integer(logits.shape[1]), integer(chunk), greedy is not None,
        mask[0] is not None, block,
    )  # fmt: skip


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
    split_race = sampling._split_race

    def recording(logits, keys, temperature, greedy, dummy, out, splits, block, mask=(None, None),
                  id_offset=0, raw=False):  # fmt: skip
        seen[phase[0]].add(variant(logits, keys, temperature, greedy, dummy, splits, block, mask))
        return split_race(logits, keys, temperature, greedy, dummy, out, splits, block, mask,
                          id_offset, raw)  # fmt: skip

    sampling._split_race = recording
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
    new = seen["requests"] - seen["warm-up"]
    assert seen["requests"] and not new, f"variants the warm-up did not launch: {new}"


if __name__ == "__main__":
    report_each(["covered"], lambda name: check_covered(name))
