"""On 2+ GPUs, float16, a small sharpened random model (as tests/distributed/test_tp_cuda.py):
TP=2 through Ray actors (NCCL, each actor seeing its node's GPUs, the custom all-reduce set up)
and DP=2 over worker processes (replica i on cuda:i) give TP=1's greedy tokens; nothing is left
running after close. Ray tests need the `ray` extra."""

from __future__ import annotations

import pytest
import torch
from helpers import child_processes, make_sharp_checkpoint, random_prompts, wait_gone

from llm_inference import LLM, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

ENGINE = dict(device="cuda", dtype="float16", kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_sharp_checkpoint(tmp_path_factory.mktemp("dp_ray_cuda"))


@pytest.fixture(scope="module")
def tp1(folder):
    with LLM(str(folder), **ENGINE) as llm:
        return [o.token_ids for o in llm.generate(random_prompts(), PARAMS, use_tqdm=False)]


def test_tp2_through_ray_equals_tp1(folder, tp1):
    ray = pytest.importorskip("ray")
    with LLM(
        str(folder), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE
    ) as llm:
        rpc = llm.engine.executor.collective_rpc
        assert rpc("uses_custom_all_reduce") == [True, True]  # the peers see each other
        pids = llm.engine.executor.worker_pids
        assert [o.token_ids for o in llm.generate(random_prompts(), PARAMS, use_tqdm=False)] == tp1
    assert not ray.is_initialized()  # the engine's own local Ray, stopped
    assert wait_gone(pids, 10) == []
    assert wait_gone([p for p, _ in child_processes()], 10) == []


def test_dp2_equals_tp1_one_gpu_each(folder, tp1):
    with LLM(str(folder), data_parallel_size=2, **ENGINE) as llm:
        replicas = llm.engine.core.replicas
        assert [r.config.device for r in replicas] == ["cuda:0", "cuda:1"]
        assert [o.token_ids for o in llm.generate(random_prompts(), PARAMS, use_tqdm=False)] == tp1
        assert all(r.stats()["num_steps"] > 0 for r in replicas)
    assert wait_gone([p for p, _ in child_processes()], 10) == []
