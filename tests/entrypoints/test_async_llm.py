"""AsyncLLM: the same greedy outputs as LLM.generate with requests joining a running batch;
a consumer that goes away aborts its request and frees its blocks; a refused request fails
alone; an engine error reaches every waiting request."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from conftest import ENGINE_ARGS, wait_all_blocks_free
from helpers import (
    child_processes,
    explode_on_step,
    is_running,
    report_gc_freeze,
    slow_steps,
    wait_gone,
)

from llm_inference import AsyncLLM, SamplingParams
from llm_inference.engine.async_llm import EngineDeadError
from llm_inference.outputs import (
    CompletionOutput,
    Logprobs,
    RequestOutput,
    RequestOutputKind,
    accumulate,
    merge_deltas,
)

PROMPTS = [f"Hello world {i}" for i in range(6)]


@pytest.fixture(scope="module")
def allm(tiny_ckpt):
    with AsyncLLM(str(tiny_ckpt), **ENGINE_ARGS) as llm:
        yield llm


async def _final(llm, prompt, params, rid=None):
    last = None
    async for out in llm.generate(prompt, params, rid):
        last = out
    return last


def test_matches_offline_and_joins_running_batch(allm, offline_llm):
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i) for i in range(6)]

    async def main():
        first = asyncio.create_task(_final(allm, PROMPTS[0], params[0]))
        await asyncio.sleep(0)  # the others join while the first runs
        rest = [_final(allm, p, sp) for p, sp in zip(PROMPTS[1:], params[1:])]
        return [await first, *await asyncio.gather(*rest)]

    outs = asyncio.run(main())
    want = offline_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.text for o in outs] == [w.text for w in want]
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert all(o.finished for o in outs)


def test_consumer_going_away_aborts_and_frees_blocks(allm):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        gen = allm.generate("The quick brown fox", params)
        first = await anext(gen)
        assert not first.finished
        await gen.aclose()  # GeneratorExit in the iterator
        started = asyncio.Event()

        async def consume():
            async for _ in allm.generate("Paris is", params):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()  # CancelledError in the iterator
        with pytest.raises(asyncio.CancelledError):
            await task
        return await asyncio.to_thread(wait_all_blocks_free, allm)

    stats = asyncio.run(main())
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_unfinished_requests"] == 0
    assert allm.metrics.snapshot().finished["abort"] >= 2


def test_refused_request_fails_alone(allm):
    async def main():
        good = asyncio.create_task(
            _final(allm, "Hello", SamplingParams(max_tokens=5, ignore_eos=True))
        )
        with pytest.raises(ValueError, match="max_model_len"):
            await _final(allm, [5] * 600, SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="already running"):
            await asyncio.gather(
                _final(allm, "a", SamplingParams(max_tokens=50), "same-id"),
                _final(allm, "b", SamplingParams(max_tokens=50), "same-id"),
            )
        return await good

    assert len(asyncio.run(main()).token_ids) == 5
    assert allm.is_running


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "thread"])
def test_engine_error_reaches_every_request(tiny_ckpt, engine_process):
    llm = AsyncLLM(str(tiny_ckpt), engine_process=engine_process, core_setup=explode_on_step,
                   **ENGINE_ARGS)  # fmt: skip

    async def main():
        results = await asyncio.gather(
            *[_final(llm, f"x {i}", SamplingParams(max_tokens=3)) for i in range(3)],
            return_exceptions=True,
        )
        return results

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "kernel exploded" in str(results[0]) + str(results[0].__cause__)
        with pytest.raises(EngineDeadError):
            asyncio.run(_final(llm, "after", SamplingParams(max_tokens=2)))
        assert not llm.is_running
    finally:
        llm.shutdown()


def test_killed_core_process_fails_requests_and_leaves_nothing(tiny_ckpt):
    """A core process killed mid-run: every waiting request gets EngineDeadError within
    seconds, later calls too; shutdown leaves no core process behind."""
    llm = AsyncLLM(str(tiny_ckpt), **ENGINE_ARGS)
    pid = llm.core_process.pid
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        gens = [llm.generate(f"x {i}", params) for i in range(3)]
        firsts = [await anext(g) for g in gens]  # all three are running
        assert not any(f.finished for f in firsts)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()

        async def drain(gen):
            async for _ in gen:
                pass

        results = await asyncio.gather(*[drain(g) for g in gens], return_exceptions=True)
        return results, time.monotonic() - start

    try:
        results, waited = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "engine core process exited" in str(results[0].__cause__)
        assert waited < 10
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(_final(llm, "after", SamplingParams(max_tokens=2)))
    finally:
        llm.shutdown()
    assert not is_running(pid)


def test_core_process_start_up_error_is_the_engine_s_own(tiny_ckpt):
    """A KV cache too small for one request, found in the core process: the same error (type
    and message) as in one process, the child's traceback chained; no process left."""
    from llm_inference.engine.core_process import EngineCoreError
    from llm_inference.engine.llm_engine import KVCacheTooSmallError

    before = {pid for pid, _ in child_processes()}
    with pytest.raises(KVCacheTooSmallError, match=r"KV cache too small.*max_model_len=512") as e:
        AsyncLLM(str(tiny_ckpt), device="cpu", kv_cache_memory_bytes=40_000, max_model_len=512)
    assert isinstance(e.value.__cause__, EngineCoreError)
    assert "Traceback" in str(e.value.__cause__)
    assert not wait_gone([pid for pid, _ in child_processes() if pid not in before], 10)


def test_core_process_freezes_its_startup_heap(tiny_ckpt):
    """The core process moves its startup heap (torch, the model) out of the GC's reach, so
    full collections there do not stall the steps."""
    with AsyncLLM(str(tiny_ckpt), core_setup=report_gc_freeze, **ENGINE_ARGS) as llm:
        assert llm.stats()["gc_frozen"] > 10_000


def test_pause_log_names_a_silent_core(tiny_ckpt, tmp_path, monkeypatch):
    """With a pause log, the front end logs each wait of 50 ms or more for a step while requests
    run (here every step takes 80 ms more), and the core process its own pauses' lines: each
    of those steps, as core_step."""
    log = tmp_path / "pauses.log"
    monkeypatch.setenv("LLM_INFERENCE_PAUSE_LOG", str(log))
    with AsyncLLM(str(tiny_ckpt), core_setup=slow_steps, **ENGINE_ARGS) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        started = time.monotonic()
        asyncio.run(_final(llm, PROMPTS[0], params))
        # the core stamps each message of steps when it sends it (core_sent's clock)
        assert started < llm.core_process.sent_at <= time.monotonic()
    silent = [line.split() for line in log.read_text().splitlines() if " core_silent " in line]
    assert len(silent) >= 3  # a step of prompt, then one per token
    assert all(float(ms) >= 50 and name == "MainProcess" for _, _, _, ms, name in silent)
    steps = [line.split() for line in log.read_text().splitlines() if " core_step " in line]
    assert len(steps) >= 3 and all(float(ms) >= 80 for _, _, _, ms, _ in steps)
    assert {line[1] for line in steps}.isdisjoint(line[1] for line in silent)  # the core's pid
    # with each silence, the core's own gap between step starts: here the slow steps (not a
    # delivery held up), at least their 80 ms; but the first silence's (the first step started
    # at once, mostly under the log's 1 ms minimum, and took the time)
    gaps = [float(line.split()[3]) for line in log.read_text().splitlines() if " core_gap " in line]
    assert len(silent) - 1 <= len(gaps) <= len(silent)
    assert sum(g >= 80 for g in gaps) >= len(silent) - 1
    # and the reading thread spent the silences waiting for those steps, not at work
    idle = [line.split() for line in log.read_text().splitlines() if " reader_idle " in line]
    assert len(idle) == len(silent)
    assert all(float(i[3]) > 0.5 * float(s[3]) for i, s in zip(idle, silent))
    # core_sent: the steps were taken as soon as sent, mostly under the log's 1 ms minimum
    assert sum(" core_sent " in line for line in log.read_text().splitlines()) <= len(silent)


def _joined(deltas, n=1):
    """Each completion's text, token ids and logprobs concatenated over DELTA outputs."""
    text, ids, lps = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for d in deltas:
        for c in d.outputs:
            text[c.index] += c.text
            ids[c.index] += c.token_ids
            lps[c.index] += c.logprobs or []
    return text, ids, lps


def test_delta_outputs_join_to_the_offline_outputs(allm, offline_llm):
    """DELTA: only new text, tokens and logprobs each time; joined, the offline output. n > 1
    and logprobs (synchronous steps) included; FINAL_ONLY: one output, the offline one."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=9, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, stop=["o"]),
    ]
    prompts = PROMPTS[:3]

    async def run(kind):
        async def one(p, sp):
            return [o async for o in allm.generate(p, sp, output_kind=kind)]

        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    deltas = asyncio.run(run(RequestOutputKind.DELTA))
    finals = asyncio.run(run(RequestOutputKind.FINAL_ONLY))
    want = offline_llm.generate(prompts, params, use_tqdm=False)
    for ds, fs, w, sp in zip(deltas, finals, want, params):
        assert all(not d.finished for d in ds[:-1]) and ds[-1].finished
        text, ids, lps = _joined(ds, sp.n)
        assert text == [c.text for c in w.outputs]
        assert ids == [c.token_ids for c in w.outputs]
        if sp.logprobs is not None:  # values to float rounding: the batches' shapes differ
            _assert_logprobs_close(lps, [c.logprobs for c in w.outputs])
        assert {c.index: c.finish_reason for d in ds for c in d.outputs if c.finished} == {
            c.index: c.finish_reason for c in w.outputs
        }
        assert len(fs) == 1 and fs[0].finished
        assert [c.text for c in fs[0].outputs] == [c.text for c in w.outputs]
        assert [c.token_ids for c in fs[0].outputs] == [c.token_ids for c in w.outputs]


def _assert_logprobs_close(got: list[list[Logprobs]], want: list[list[Logprobs]]) -> None:
    """Same tokens and top-k ids; log-probabilities equal to float32 rounding."""
    assert [[lp.token_id for lp in c] for c in got] == [[lp.token_id for lp in c] for c in want]
    for g, w in zip(sum(got, []), sum(want, [])):
        assert list(g.top) == list(w.top)
        assert g.logprob == pytest.approx(w.logprob, rel=1e-5, abs=1e-5)
        assert list(g.top.values()) == pytest.approx(list(w.top.values()), rel=1e-5, abs=1e-5)


def test_lagging_consumer_gets_merged_deltas(allm, offline_llm):
    """A consumer that falls behind gets the pending deltas merged into one: fewer outputs,
    nothing lost; cumulative outputs skip ahead the same way."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = offline_llm.generate([PROMPTS[4]], params, use_tqdm=False)[0]

    async def lagging(kind):
        outs = []
        async for out in allm.generate(PROMPTS[4], params, output_kind=kind):
            outs.append(out)
            if len(outs) == 1:  # block the event loop until the engine is done: however fast
                deadline = time.monotonic() + 60  # it steps, every later delta is pending
                while allm.stats()["num_unfinished_requests"] and time.monotonic() < deadline:
                    time.sleep(0.01)
        return outs

    deltas = asyncio.run(lagging(RequestOutputKind.DELTA))
    assert 1 < len(deltas) < 60, len(deltas)
    assert any(len(d.outputs[0].token_ids) > 1 for d in deltas)
    text, ids, _ = _joined(deltas)
    assert (text[0], ids[0]) == (want.text, want.token_ids)
    cumulative = asyncio.run(lagging(RequestOutputKind.CUMULATIVE))
    assert len(cumulative) < 60
    lengths = [len(o.token_ids) for o in cumulative]
    assert lengths == sorted(set(lengths))
    assert (cumulative[-1].text, cumulative[-1].token_ids) == (want.text, want.token_ids)


def test_merge_deltas_and_accumulate():
    lp = [Logprobs(1, -0.5), Logprobs(2, -0.25), Logprobs(3, -1.0)]
    d1 = RequestOutput("r", "p", [9], [CompletionOutput(0, "a", [1], None, lp[:1], None, -0.5),
                                        CompletionOutput(1, "x", [7], None, [], None, None)],
                       False)  # fmt: skip
    d2 = RequestOutput("r", "p", [9], [CompletionOutput(0, "bc", [2, 3], "stop", lp[1:], "c",
                                                        -1.75)], False)  # fmt: skip
    d3 = RequestOutput("r", "p", [9], [CompletionOutput(1, "", [8], "length", [], None, None)],
                       True)  # fmt: skip
    merged = merge_deltas([d1, d2, d3])
    assert merged.finished and [c.index for c in merged.outputs] == [0, 1]
    c0, c1 = merged.outputs
    assert (c0.text, c0.token_ids, c0.logprobs, c0.finish_reason) == ("abc", [1, 2, 3], lp, "stop")
    assert c0.cumulative_logprob == -1.75 and c0.stop_reason == "c"
    assert (c1.text, c1.token_ids, c1.finish_reason) == ("x", [7, 8], "length")
    assert d1.outputs[0].token_ids == [1] and d1.outputs[0].text == "a"  # inputs untouched
    assert merge_deltas([d1]) is d1
    total = None
    for d in (d1, d2, d3):
        total = accumulate(total, d, 2)
    assert [(c.text, c.token_ids) for c in total.outputs] == [("abc", [1, 2, 3]), ("x", [7, 8])]
    assert total.finished


def test_prompt_logprobs_stream_once(allm, offline_llm):
    """A DELTA stream carries the prompt logprobs in one output; a CUMULATIVE one in every
    output from the first; both equal the offline engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2, ignore_eos=True)
    (want,) = offline_llm.generate([PROMPTS[0]], params, use_tqdm=False)

    async def collect(kind):
        return [o async for o in allm.generate(PROMPTS[0], params, output_kind=kind)]

    deltas = asyncio.run(collect(RequestOutputKind.DELTA))
    carried = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(carried) == 1 and carried[0] == want.prompt_logprobs
    assert len(want.prompt_logprobs) == len(want.prompt_token_ids)
    cumulative = asyncio.run(collect(RequestOutputKind.CUMULATIVE))
    assert all(o.prompt_logprobs == want.prompt_logprobs for o in cumulative)


def test_outputs_flow_while_a_send_to_the_core_waits(tiny_ckpt):
    """A core that reads no command for a while (it reads between steps: a request of many
    prompts fills the pipe meanwhile): the send to it waits, and a running stream keeps getting
    its tokens all along; the waiting requests run once it reads."""
    llm = AsyncLLM(str(tiny_ckpt), **ENGINE_ARGS)
    conn = llm.core_process._conn
    send, held, read = conn.send, threading.Event(), threading.Event()

    def full_pipe(message):  # as Connection.send on a pipe that the core does not read
        held.set()
        read.wait()
        send(message)

    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def main():
        stream = llm.generate("The quick brown fox", long, output_kind=RequestOutputKind.DELTA)
        tokens = len((await anext(stream)).outputs[0].token_ids)
        conn.send = full_pipe
        many = [asyncio.create_task(_final(llm, f"hi {i}", short)) for i in range(50)]
        assert await asyncio.to_thread(held.wait, 30)  # the send waits on the core
        unstuck = threading.Timer(60, read.set)  # ends the test if the stream stalls too
        unstuck.start()
        while_held = 0
        async for out in stream:
            tokens += len(out.outputs[0].token_ids)
            if read.is_set():
                break
            while_held += 1
            if while_held == 10:
                read.set()  # the core reads at last
        unstuck.cancel()
        read.set()
        async for out in stream:
            tokens += len(out.outputs[0].token_ids)
        return while_held, tokens, await asyncio.gather(*many)

    try:
        while_held, tokens, outs = asyncio.run(main())
    finally:
        read.set()
        llm.shutdown()
    assert while_held == 10, "the stream stalled while the send to the core waited"
    assert tokens == 300
    assert [len(o.token_ids) for o in outs] == [2] * 50


def test_shutdown_of_a_front_end_stuck_on_the_core_pipe_ends(tiny_ckpt, monkeypatch):
    """The front-end thread stuck reading the core's pipe (a message that a frozen core left
    half-written): shutdown() still returns, after its timeout, by killing the core process;
    the waiting request gets EngineDeadError."""
    from llm_inference.engine import async_llm
    from llm_inference.engine.core_process import CoreClient, EngineCoreError

    monkeypatch.setattr(async_llm, "SHUTDOWN_TIMEOUT_S", 1.0)
    llm = AsyncLLM(str(tiny_ckpt), **ENGINE_ARGS)
    pid, core, blocked, result = llm.core_process.pid, llm.core_process, threading.Event(), []

    def stuck(self, timeout=None):  # as Connection.recv waits for the rest: until it breaks
        blocked.set()
        while is_running(pid):
            time.sleep(0.01)
        raise EngineCoreError("the engine core process exited")

    def request():
        try:
            asyncio.run(_final(llm, "x", SamplingParams(max_tokens=2)))
        except Exception as e:  # noqa: BLE001 - what the request ended with
            result.append(e)

    monkeypatch.setattr(CoreClient, "recv", stuck)
    client = threading.Thread(target=request, daemon=True)
    client.start()
    assert blocked.wait(30)  # the engine thread is stuck reading the core's step
    closer = threading.Thread(target=llm.shutdown, daemon=True)
    closer.start()
    closer.join(timeout=30)
    client.join(timeout=30)
    assert not closer.is_alive() and not is_running(pid), "shutdown hung"
    assert len(result) == 1 and isinstance(result[0], EngineDeadError), result
    core.shutdown()
