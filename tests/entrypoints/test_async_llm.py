"""AsyncLLM: the same greedy outputs as LLM.generate with requests joining a running batch;
a consumer that goes away aborts its request and frees its blocks; a refused request fails
alone; an engine error reaches every waiting request."""

from __future__ import annotations

import asyncio

import pytest
from conftest import ENGINE_ARGS, wait_all_blocks_free

from llm_inference import AsyncLLM, SamplingParams
from llm_inference.engine.async_llm import EngineDeadError

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


def test_engine_error_reaches_every_request(tiny_ckpt):
    llm = AsyncLLM(str(tiny_ckpt), **ENGINE_ARGS)

    def boom():
        raise RuntimeError("kernel exploded")

    async def main():
        llm.engine.step = boom  # read by the engine thread at its next step
        results = await asyncio.gather(
            *[_final(llm, f"x {i}", SamplingParams(max_tokens=3)) for i in range(3)],
            return_exceptions=True,
        )
        return results

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "kernel exploded" in str(results[0])
        with pytest.raises(EngineDeadError):
            asyncio.run(_final(llm, "after", SamplingParams(max_tokens=2)))
        assert not llm.is_running
    finally:
        llm.shutdown()
