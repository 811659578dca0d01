"""The real default model (SmolLM2-135M: 9 heads, 3 KV heads) at TP=3 over gloo, with async
scheduling, equals TP=1: greedy under preemption, and seeded sampling."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import chat_prompt_ids, child_processes

from llm_inference import LLM
from llm_inference.models.default_model import resolve_model
from llm_inference.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "2+2=",
    "Who wrote the play Hamlet?",
    "List three primary colors.",
]
MAX_NEW = 12
BLOCK_BYTES_TP1 = 30 * 2 * 16 * 3 * 64 * 4  # layers * (K,V) * block * kv heads * head_dim * 4
# TP=3: one KV head per rank, so these bytes hold 11 blocks: the batch preempts (with async
# scheduling, the default; 12 blocks happen not to). Chat prompts share their template:
# without prefix caching they contend for the blocks.
NUM_BLOCKS = 11
PREEMPTING = dict(
    kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_BYTES_TP1 // 3,
    max_model_len=96,
    enable_prefix_caching=False,
)
SEEDED = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=MAX_NEW) for i in range(4)]


@pytest.fixture(scope="module")
def prompts():
    return chat_prompt_ids(resolve_model(None), QUESTIONS)


def run(prompts, tp: int, **kw) -> tuple[list, list, dict]:
    with LLM(
        resolve_model(None), device="cpu", dtype="float32", tensor_parallel_size=tp, **kw
    ) as llm:
        greedy = llm.generate(prompts, max_new_tokens=MAX_NEW, use_tqdm=False)
        sampled = llm.generate(prompts[:4], SEEDED, use_tqdm=False)
        stats = llm.stats()
    return [o.token_ids for o in greedy], [o.token_ids for o in sampled], stats


def test_smollm2_tp3_matches_tp1(prompts):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # like each rank: no oversubscription of small CI machines
        want_greedy, want_sampled, _ = run(prompts, 1, max_model_len=96)
    finally:
        torch.set_num_threads(threads)
    greedy, sampled, stats = run(prompts, 3, **PREEMPTING)
    assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == NUM_BLOCKS
    for i, (got, want) in enumerate(zip(greedy, want_greedy)):
        assert got == want, f"prompt {i}"
    assert sampled == want_sampled
    assert child_processes() == []
