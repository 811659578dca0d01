"""The real default model (SmolLM2-135M-Instruct): LLM.generate equals transformers' greedy
generate token for token, also under preemption and with max_num_seqs=2 (float32)."""

from __future__ import annotations

import pytest
import torch
from helpers import chat_prompt_ids

from llm_inference import LLM
from llm_inference.models.default_model import resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "List three primary colors and explain in one sentence why they are called primary.",
    "2+2=",
    "Translate 'good morning' into Spanish, French and German, one per line please.",
    "Who wrote the play Hamlet?",
    "Explain recursion to a five year old child using a short story about nesting dolls.",
]
MAX_NEW = 16
BLOCK_BYTES_F32 = 30 * 2 * 16 * 3 * 64 * 4  # layers * (K,V) * block * kv heads * head_dim * 4


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(None)


@pytest.fixture(scope="module")
def prompts(model_dir):
    return chat_prompt_ids(model_dir, QUESTIONS)


@pytest.fixture(scope="module")
def hf_tokens(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(kv_cache_memory_bytes=200 * BLOCK_BYTES_F32, max_model_len=256),
        dict(kv_cache_memory_bytes=12 * BLOCK_BYTES_F32, max_model_len=192),
        dict(kv_cache_memory_bytes=200 * BLOCK_BYTES_F32, max_model_len=256, max_num_seqs=2),
    ],
    ids=["plain", "preempting", "max_num_seqs_2"],
)
def test_smollm2_greedy_matches_transformers(model_dir, prompts, hf_tokens, engine_kw):
    assert len(set(map(len, prompts))) == len(prompts)  # all lengths differ
    with LLM(model_dir, device="cpu", dtype="float32", **engine_kw) as llm:
        outs = llm.generate(prompts, max_new_tokens=MAX_NEW, use_tqdm=False)
        stats = llm.stats()
    for i, (o, want) in enumerate(zip(outs, hf_tokens)):
        assert o.token_ids == want, f"prompt {i}"
    if engine_kw["kv_cache_memory_bytes"] < 20 * BLOCK_BYTES_F32:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert "Paris" in outs[0].text
