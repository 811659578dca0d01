"""On CUDA: Qwen2 (qkv bias) and Qwen3 (q/k norm, head_dim 128) on the Triton kernels with CUDA
graphs give the reference kernels' greedy tokens (float16), at one GPU and at two; a near-tie
of the reference may part them (helpers.assert_greedy_close, as test_triton_engine.py)."""

from __future__ import annotations

import pytest
import torch
from families import make_family_checkpoint
from helpers import assert_greedy_close, random_prompts

from llm_inference import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEAR_TIE = 0.15  # log-probability gap under which fp16 rounding may flip the argmax
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
             num_key_value_heads=2, num_hidden_layers=3)  # fmt: skip
CASES = {"qwen2": ("qwen2", {"head_dim": 64}), "qwen3": ("qwen3", {"head_dim": 128})}


def _sharp(folder, family, **overrides):
    """The LM head scaled by 4: peaked next-token distributions, so near-ties are rare."""
    from safetensors.torch import load_file, save_file

    folder = make_family_checkpoint(folder, family, **{**SHAPE, **overrides})
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] *= 4.0
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_greedy_equals_reference(tmp_path, case, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    family, overrides = CASES[case]
    folder = _sharp(tmp_path / case, family, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    runs = {}
    for backend in ("auto", "reference"):
        with LLM(str(folder), device="cuda", dtype="float16", kernel_backend=backend,
                 kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
                 tensor_parallel_size=tp) as llm:  # fmt: skip
            runs[backend] = llm.generate(random_prompts(), params, use_tqdm=False)
    assert_greedy_close(runs["auto"], runs["reference"], NEAR_TIE, "Triton")
