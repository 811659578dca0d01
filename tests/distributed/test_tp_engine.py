"""Tensor parallelism end to end on the CPU (gloo), tiny random model (4 heads, 2 KV heads):
TP=2 equals TP=1, with async scheduling (the default: step n+1 sent to the workers before step
n's tokens are read) and without (greedy under preemption and chunked prefill, seeded sampling,
a mixed batch with logprobs, prompt logprobs, penalties, logit biases and bad words, structured
outputs: each rank masks its vocabulary slice with the step's grammar bitmask, sent with the
step's sampling call after its forward under async scheduling); steps, an
empty step and a collective_rpc sent before the earlier replies are read; worker processes
never outlive the LLM (context manager, exceptions, a killed worker, Ctrl-C, an LLM never
closed, a parent that dies); clear errors for sizes that do not fit. Engine instances are few:
each start spawns processes that import torch."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import pytest
import torch
from helpers import child_processes, is_running, wait_gone

from llm_inference import LLM
from llm_inference.core.outputs import CachedRequestData, SchedulerOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.engine.arg_utils import EngineArgs
from llm_inference.executor import multiproc
from llm_inference.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PROMPTS = [
    [1, 5, 9, 20],
    [3, 4],
    list(range(10, 50)),
    [7] * 13,
    list(range(100, 300, 7)),
    [42],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Per rank: TP=2 holds half the KV heads, so the same bytes give twice the blocks: TP=1 gets
# 4 blocks (one 64-token request), TP=2 gets 8; both preempt on this batch.
BLOCK_BYTES_TP1 = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head_dim * 4
ENGINE = dict(device="cpu", kv_cache_memory_bytes=4 * BLOCK_BYTES_TP1, max_model_len=64)
SYNC = dict(async_scheduling=False)
CHUNKED = dict(ENGINE, max_num_batched_tokens=16, max_num_seqs=3)  # prompts in chunks of 16
# name: (tensor_parallel_size, engine arguments); async scheduling unless SYNC
CONFIGS = {
    1: (1, ENGINE),
    "1-sync": (1, dict(ENGINE, **SYNC)),
    2: (2, ENGINE),
    "2-sync": (2, dict(ENGINE, **SYNC)),
    "chunked-1": (1, dict(CHUNKED, **SYNC)),
    "chunked-2": (2, CHUNKED),
}


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=24, ignore_eos=True)


FORCED, ALLOWED = 250, [5, 17, 33]
MIXED = [
    GREEDY.replace(logit_bias={FORCED: 100.0, 3: -50.0}),
    seeded(1).replace(allowed_token_ids=ALLOWED),
    SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=16),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=16, bad_words=["the"]),
    SamplingParams(temperature=0.0, min_tokens=8, max_tokens=16),
]


def structured(llm: LLM) -> list:
    """Constrained answers (JSON greedy and seeded, a regex, a choice with logprobs: its steps
    one at a time, the others' overlapped once it ends) beside a plain seeded request, under
    preemption."""
    from llm_inference import StructuredOutputsParams as S

    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99},
              "b": {"enum": ["x", "yz"]}}, "required": ["a", "b"]}  # fmt: skip
    so = S(json=schema, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so),
        seeded(2).replace(ignore_eos=False, structured_outputs=so),
        seeded(3).replace(ignore_eos=False, structured_outputs=so),
        seeded(4).replace(ignore_eos=False, structured_outputs=S(regex=r"[a-z]{2,4}\d")),
        seeded(5).replace(
            ignore_eos=False, logprobs=2, structured_outputs=S(choice=["one", "two"])
        ),
        seeded(6),
    ]
    prompts = [PROMPTS[i] for i in (0, 1, 3, 5, 0, 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]  # fmt: skip


def run_all(llm: LLM) -> dict:
    gen = lambda params: llm.generate(PROMPTS, params, use_tqdm=False)  # noqa: E731
    out = {
        "greedy": [o.token_ids for o in gen(GREEDY)],
        "seeded": [o.token_ids for o in gen([seeded(i) for i in range(len(PROMPTS))])],
    }
    mixed = gen(MIXED)
    out["mixed"] = [o.token_ids for o in mixed]
    out["logprobs"] = [o.outputs[0].logprobs for o in mixed]
    out["prompt_logprobs"] = [o.prompt_logprobs for o in mixed]
    out["stats"] = llm.stats()
    return out


def steps_interleaved(llm: LLM) -> dict:
    """Below the engine: two steps sent before either reply is read, then (a request
    aborted meanwhile) a collective_rpc and the empty step that tells the workers; the late
    replies are read on the way and kept for their handles."""
    engine = llm.engine
    sched, executor = engine.scheduler, engine.executor
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, seed=0)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[2])):
        sched.add_request(Request(rid, prompt, params, max_tokens=2))
    first = sched.schedule()  # both prompts
    h1 = executor.execute_model(first, sync=False)
    second = sched.schedule()  # both decode their in-flight sample
    h2 = executor.execute_model(second, sync=False)
    owed = len(executor.processes._calls)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    blocks = executor.collective_rpc("kv_bytes_per_block")
    empty = sched.schedule()  # nothing to run: only tells the workers that b finished
    assert empty.is_empty and empty.finished_request_ids == ["b"]
    executor.execute_model(empty)
    out1, out2 = h1.result(), h2.result()
    sched.update_from_output(first, out1)
    sched.update_from_output(second, out2)
    tokens = {}
    for out in (out1, out2):
        for rid, sampled in zip(out.request_ids, out.sampled_token_ids):
            tokens.setdefault(rid, []).extend(sampled)
    return {"owed": owed, "blocks": blocks, "tokens": tokens, "left": sched.requests}


def profiled(llm: LLM) -> dict:
    """LLM.start_profile / stop_profile around a generate: each rank's summary and trace."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        llm.start_profile(folder)
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        ranks = llm.stop_profile()
        traces = {p: json.loads(open(os.path.join(folder, p)).read()) for p in os.listdir(folder)}
    return {"ranks": ranks, "traces": traces}


@pytest.fixture(scope="module")
def runs(tiny_ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank: TP=1 is far slower on a busy 2-core machine
    try:
        return _run_configs(tiny_ckpt)
    finally:
        torch.set_num_threads(threads)


def _run_configs(tiny_ckpt) -> dict:
    results = {}
    real_submit = multiproc.MultiprocWorkers.submit
    for name, (tp, kw) in CONFIGS.items():
        owed = []  # per step sent: calls whose replies were still unread
        apart = []  # the same, per step sampled apart (its forward first: structured outputs)

        def submit(self, method, *args):
            if method == "execute_model":
                owed.append(len(self._calls))  # noqa: B023
                if not args[2]:
                    apart.append(len(self._calls))  # noqa: B023
            return real_submit(self, method, *args)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(multiproc.MultiprocWorkers, "submit", submit)
            with LLM(str(tiny_ckpt), tensor_parallel_size=tp, **kw) as llm:
                res = results[name] = run_all(llm)
                res["pids"] = llm.engine.executor.worker_pids
                res["alive"] = [is_running(p) for p in res["pids"]]
                res["max_owed"] = max(owed, default=None)
                if name in (1, "1-sync", 2):
                    res["structured"] = structured(llm)
                    res["apart"] = apart
                if name == 2:
                    res["interleaved"] = steps_interleaved(llm)
                    res["profile"] = profiled(llm)
                    res["gc_frozen"] = llm.engine.executor.collective_rpc("gc_frozen_objects")
        res["children_after"] = child_processes()
    return results


def test_greedy_under_preemption_matches_tp1(runs):
    assert runs[2]["greedy"] == runs[1]["greedy"]
    assert all(len(t) == 24 for t in runs[2]["greedy"])
    assert runs[1]["stats"]["num_preemptions"] > 0
    assert runs[2]["stats"]["num_preemptions"] > 0
    assert runs[2]["stats"]["num_kv_blocks"] == 2 * runs[1]["stats"]["num_kv_blocks"]


def test_workers_freeze_their_startup_heap(runs):
    """Each worker process moves its startup heap (torch, its shard) out of the cyclic GC's
    reach, so full collections there do not stall the steps."""
    assert all(n > 10_000 for n in runs[2]["gc_frozen"]), runs[2]["gc_frozen"]


def test_profiler_runs_on_every_rank(runs):
    """Each worker process profiles itself: two summaries, each with the matmuls the rank ran
    (on the CPU, operators), and one Chrome trace per rank."""
    prof = runs[2]["profile"]
    assert [r["rank"] for r in prof["ranks"]] == [0, 1]
    for r in prof["ranks"]:
        assert r["device"] == "cpu" and r["total_ms"] > 0
        mm = [k for name, k in r["kernels"].items() if name in ("aten::mm", "aten::addmm")]
        assert mm and sum(k["calls"] for k in mm) >= 2 * 24  # 2 layers, 24+ forward passes
    assert sorted(prof["traces"]) == ["rank0.json", "rank1.json"]
    assert all(t["traceEvents"] for t in prof["traces"].values())


@pytest.mark.parametrize("name", ["1-sync", "2-sync", "chunked-1", "chunked-2"])
def test_async_and_sync_at_tp1_and_tp2_agree(runs, name):
    """Async scheduling at TP=2 overlaps (a step is sent while the one before is unread);
    tokens equal TP=1's with and without it, under preemption and with chunked prefill."""
    assert runs[2]["max_owed"] == 1  # never more than one step ahead
    assert runs["2-sync"]["max_owed"] == 0 and runs["chunked-2"]["max_owed"] == 1
    for key in ("greedy", "seeded", "mixed"):
        assert runs[name][key] == runs[1][key], key
    assert runs[name]["stats"]["num_preemptions"] > 0


def test_seeded_sampling_matches_tp1(runs):
    assert runs[2]["seeded"] == runs[1]["seeded"]
    assert runs[2]["seeded"] != runs[2]["greedy"]


def test_mixed_batch_matches_tp1(runs):
    """Greedy rows with penalties, min_tokens, logprobs or a logit bias take the full-logits
    path; so does a sampled row with allowed_token_ids."""
    assert runs[2]["mixed"] == runs[1]["mixed"]
    assert set(runs[2]["mixed"][0]) == {FORCED}
    assert set(runs[2]["mixed"][1]) <= set(ALLOWED) and len(set(runs[2]["mixed"][1])) > 1
    lp1, lp2 = runs[1]["logprobs"][2], runs[2]["logprobs"][2]
    assert lp1 and len(lp1) == len(lp2)
    for a, b in zip(lp1, lp2):
        assert a.token_id == b.token_id and set(a.top) == set(b.top)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    # prompt logprobs: the logits of every prompt position gathered over the ranks
    plp1, plp2 = runs[1]["prompt_logprobs"], runs[2]["prompt_logprobs"]
    assert [p is None for p in plp2] == [i != 2 for i in range(len(MIXED))]
    assert len(plp2[2]) == len(PROMPTS[2]) and plp2[2][0] is None
    for a, b in zip(plp1[2][1:], plp2[2][1:]):
        assert a.token_id == b.token_id and set(a.top) == set(b.top) and len(a.top) == 2
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_structured_outputs_match_tp1(runs):
    """Every rank masks its slice with the same bitmask: greedy rows take the distributed
    argmax of the masked slices, sampled ones the gathered masked logits; the answers are TP=1's
    token for token, with and without async scheduling, and each follows its grammar. With it,
    the ranks run constrained steps in two calls, the forward sent before the step before's
    replies are read, the sampling once the bitmask is filled."""
    assert runs[2]["structured"] == runs[1]["structured"] == runs["1-sync"]["structured"]
    assert sum(owed > 0 for owed in runs[2]["apart"]) > 10
    answers = [text for _, text, reason in runs[2]["structured"][:5] if reason == "stop"]
    assert len(answers) == 5, runs[2]["structured"]
    for text in answers[:3]:
        value = json.loads(text)
        assert set(value) == {"a", "b"} and value["b"] in ("x", "yz"), text
    assert re.fullmatch(r"[a-z]{2,4}\d", answers[3]) and answers[4] in ("one", "two")


def test_steps_empty_step_and_rpc_interleave(runs):
    got = runs[2]["interleaved"]
    assert got["owed"] == 2  # both steps sent, neither reply read
    assert len(set(got["blocks"])) == 1 and got["blocks"][0] > 0
    greedy = runs[1]["greedy"]
    assert got["tokens"] == {"a": greedy[0][:2], "b": greedy[2][:2]}
    assert got["left"] == {}  # a finished at max_tokens, b was aborted


def test_context_manager_leaves_no_process(runs):
    assert len(runs[2]["pids"]) == 2 and all(runs[2]["alive"])
    assert not any(is_running(p) for p in runs[2]["pids"])
    assert runs[2]["children_after"] == []


@pytest.mark.parametrize("rank", [1, 0])
def test_worker_killed_mid_generate_raises_quickly(tiny_ckpt, rank):
    """Async scheduling: the parent may be sending step n+1 or reading step n's replies, and
    rank 0 may be launching a step while its reply thread waits for the one before."""
    killed_at = []

    def kill_later(pid):
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with pytest.raises(multiproc.WorkerError, match=rf"rank {rank} .*died.*SIGKILL") as info:
        with LLM(str(tiny_ckpt), tensor_parallel_size=2, device="cpu", max_model_len=512) as llm:
            assert llm.engine.config.async_scheduling
            pids = llm.engine.executor.worker_pids
            threading.Thread(target=kill_later, args=(pids[rank],), daemon=True).start()
            llm.generate(PROMPTS * 4, long, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 10.0
    del info
    assert wait_gone(pids, 1.0) == []
    assert child_processes() == []


def test_errors_in_async_steps(tiny_ckpt, tmp_path):
    """NaN logits: rank 0's reply thread raises as it reports a step's tokens, while its main
    thread may already run the next step: a WorkerError with the sampler's message, and the
    ranks stay in step (the later replies are read and dropped by the next call). A step that
    raises inside execute_model, with another step queued behind it: a WorkerError with the
    traceback, the queued step is not run, and the workers are unusable."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan_head"
    shutil.copytree(tiny_ckpt, broken)
    path = broken / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"][7] = float("nan")  # token 7's logit is NaN in every row
    save_file(tensors, path)
    with LLM(str(broken), tensor_parallel_size=2, **ENGINE) as llm:
        executor = llm.engine.executor
        pids = executor.worker_pids
        nan = r"rank 0 raised in execute_model(?s:.*)NaN"
        with pytest.raises(multiproc.WorkerError, match=nan):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert executor.collective_rpc("kv_bytes_per_block") == [BLOCK_BYTES_TP1 // 2] * 2
        assert all(is_running(p) for p in pids)
        ghost = SchedulerOutput(
            step_id=-1,
            new_requests=[],
            cached_requests=CachedRequestData(["ghost"], [[]], [[]], [0]),
            num_scheduled_tokens={"ghost": 1},
            total_num_scheduled_tokens=1,
        )
        first = executor.execute_model(ghost, sync=False)
        second = executor.execute_model(ghost, sync=False)
        start = time.monotonic()
        with pytest.raises(multiproc.WorkerError, match=r"rank 0 raised in (?s:.*)KeyError"):
            first.result()
        with pytest.raises(multiproc.WorkerError, match=r"unusable \(rank 0 raised inside"):
            second.result()
        with pytest.raises(multiproc.WorkerError, match="unusable"):
            executor.collective_rpc("kv_bytes_per_block")
        assert time.monotonic() - start < 10.0
    assert wait_gone(pids, 1.0) == []
    assert child_processes() == []


def test_interrupt_keeps_ranks_in_step_and_finalizer_stops_workers(tiny_ckpt, runs, monkeypatch):
    """Ctrl-C: workers ignore SIGINT; a KeyboardInterrupt while the parent waits for a step
    leaves the engine usable (the next call collects the late replies). An LLM never closed
    stops its workers when collected."""
    llm = LLM(str(tiny_ckpt), tensor_parallel_size=2, **ENGINE)
    pids = llm.engine.executor.worker_pids
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    real_wait, calls = multiproc.wait_connections, []

    def interrupted_wait(conns, timeout):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_wait(conns, timeout)

    monkeypatch.setattr(multiproc, "wait_connections", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(is_running(p) for p in pids)
    monkeypatch.setattr(multiproc, "wait_connections", real_wait)
    # An exception on the ranks comes back with its traceback; the ranks stay usable.
    with pytest.raises(multiproc.WorkerError, match=r"rank 0 raised in no_such_method(.|\n)*"):
        llm.engine.executor.collective_rpc("no_such_method")
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == runs[1]["greedy"]
    del llm, again
    gc.collect()
    assert wait_gone(pids, 1.0) == []
    assert child_processes() == []


def test_exception_inside_with_leaves_no_process(tiny_ckpt):
    with pytest.raises(ZeroDivisionError):
        with LLM(str(tiny_ckpt), tensor_parallel_size=2, **ENGINE) as llm:
            pids = llm.engine.executor.worker_pids
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
            1 / 0  # noqa: B018
    assert wait_gone(pids, 1.0) == []
    assert child_processes() == []


SCRIPT = """
import json, sys, time
from llm_inference import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", max_model_len=64)
    print(json.dumps(llm.engine.executor.worker_pids), flush=True)
    if sys.argv[2] == "hang":
        time.sleep(120)
"""


@pytest.mark.parametrize("how", ["exit_without_close", "parent_killed"])
def test_workers_never_outlive_their_parent(tiny_ckpt, tmp_path, how):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    mode = "exit" if how == "exit_without_close" else "hang"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_ckpt), mode], stdout=subprocess.PIPE, env=env
    )
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 2
        if how == "parent_killed":
            proc.kill()
        assert proc.wait(30) in (0, -signal.SIGKILL)
        assert wait_gone(pids, 10.0) == []
    finally:
        proc.kill()
        proc.wait()


def test_sizes_that_do_not_fit_give_clear_errors(tiny_ckpt, monkeypatch):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible"):
        LLM(str(tiny_ckpt), tensor_parallel_size=3, device="cpu")
    cap = multiproc.CPU_RANKS_PER_CORE * os.cpu_count()
    with pytest.raises(ValueError, match=rf"at most {cap} ranks"):
        LLM(str(tiny_ckpt), tensor_parallel_size=cap + 4, device="cpu")
    # CUDA: the visible GPU count (checked without a GPU here)
    llm_config = replace(_config(tiny_ckpt, 2), device="cuda")  # nothing touches CUDA
    monkeypatch.setattr(multiproc.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 CUDA devices .* only 1 are visible"):
        multiproc.check_parallel_config(llm_config)
    assert child_processes() == []


def _config(path, tp):
    return EngineArgs(str(path), device="cpu", tensor_parallel_size=tp).create_engine_config()


def test_worker_start_up_error_is_reported_and_cleaned_up(tiny_ckpt, tmp_path):
    """A checkpoint that fails in the workers (a tensor missing): the worker's own error text,
    and no process left."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, broken)
    path = broken / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(multiproc.WorkerError, match=r"(?s)start-up.*missing tensors"):
        LLM(str(broken), tensor_parallel_size=2, device="cpu", max_model_len=64)
    assert child_processes() == []


def test_tp4_replicates_kv_heads_and_matches_tp1(tiny_ckpt, runs):
    """TP=4 over 2 KV heads: each rank holds a replica of one KV head (and one query head);
    greedy outputs under preemption equal TP=1's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(str(tiny_ckpt), tensor_parallel_size=4, **ENGINE) as llm:
            got = run_all(llm)
            pids = llm.engine.executor.worker_pids
    finally:
        torch.set_num_threads(threads)
    assert got["greedy"] == runs[1]["greedy"]
    assert got["seeded"] == runs[1]["seeded"]
    assert got["stats"]["num_preemptions"] > 0
    assert len(pids) == 4
    assert not wait_gone(pids, 10)


def test_async_llm_core_process_runs_tensor_parallel(tiny_ckpt, runs):
    """The server's engine core process starts the TP workers itself: AsyncLLM at TP=2 streams
    TP=1's greedy outputs, and after shutdown neither the core process nor a worker is left."""
    import asyncio

    from llm_inference import AsyncLLM

    async def main(llm):
        async def one(prompt):
            last = None
            async for out in llm.generate(prompt, GREEDY):
                last = out
            return last.outputs[0].token_ids

        return await asyncio.gather(*(one(p) for p in PROMPTS))

    llm = AsyncLLM(str(tiny_ckpt), tensor_parallel_size=2, **ENGINE)
    try:
        core = llm.core_process.pid
        workers = [pid for pid, _ in child_processes(core)]
        assert len(workers) == 2
        greedy = asyncio.run(main(llm))
    finally:
        llm.shutdown()
    assert greedy == runs[1]["greedy"]
    assert not wait_gone([core, *workers], 10)
    assert not child_processes()
