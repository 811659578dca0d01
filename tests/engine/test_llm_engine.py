"""LLMEngine.step(): per-step outputs for streaming, n fan-in, aborts and request ids."""

from __future__ import annotations

import pytest

from llm_inference import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        yield llm


def drain(engine, limit=500):
    """Step until idle; all outputs per request id, in order."""
    seen: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    engine.step()  # deliver the last finished ids to the workers
    return seen


def test_step_streams_growing_text_that_ends_as_the_final_text(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", list(range(10, 40)), params)
    seen = drain(engine)
    for rid in ("a", "b"):
        outs = seen[rid]
        assert len(outs) == 12  # one output per step that gave the request a token
        texts = [o.outputs[0].text for o in outs]
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
        assert [len(t) for t in ids] == list(range(1, 13))
        assert [o.finished for o in outs] == [False] * 11 + [True]
        final = llm.generate([outs[0].prompt_token_ids], params, use_tqdm=False)[
            0
        ]  # same greedy request through LLM
        assert texts[-1] == final.text and ids[-1] == final.token_ids


def test_n_completions_fan_in_to_one_output(llm):
    engine = llm.engine
    engine.add_request("n", [5, 6, 7], SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5))
    outs = drain(engine)["n"]
    last = outs[-1]
    assert last.finished and [c.index for c in last.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in last.outputs)
    assert len({tuple(c.token_ids) for c in last.outputs}) > 1  # different derived seeds
    assert llm.stats()["num_free_kv_blocks"] == llm.stats()["num_kv_blocks"]


def test_abort_by_string_id_and_live_id_reuse(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("req-1", [5, 6, 7], params)
    engine.step()
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("req-1", [8, 9], params)
    outs = engine.abort_request("req-1")  # a string, not a list of characters
    assert [o.request_id for o in outs] == ["req-1"]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert engine.step() == []  # the step in flight ends; it reports nothing of req-1
    assert not engine.has_unfinished_requests()
    engine.step()
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    # The id is free again, and a request aborted on its first chunk does not confuse the
    # scheduler when the id comes back at once.
    engine.add_request("req-1", [5, 6, 7], params)
    engine.abort_request("req-1")
    engine.add_request("req-1", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(drain(engine)["req-1"][-1].outputs[0].token_ids) == 3


def test_rejected_request_leaves_no_state(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("big", [5] * 600, SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request("bad", [5], {"temperature": 0.5})
    assert "big" not in engine.output_processor and "bad" not in engine.output_processor
    assert not engine.has_unfinished_requests()


def test_interrupt_while_adding_requests_leaves_nothing_behind(llm, monkeypatch):
    add = llm.engine.add_request
    calls = {"n": 0}

    def flaky_add(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", flaky_add)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6]] * 5, max_new_tokens=3, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.output_processor.requests
    out = llm.generate([[5, 6]] * 2, max_new_tokens=3, use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [3, 3]


def test_stop_token_text_is_dropped_unless_asked(llm):
    tok = llm.tokenizer
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=40,
                          ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    stop_id = greedy.token_ids[5]  # a token the model does emit
    cut = greedy.token_ids.index(stop_id)
    base = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id])
    out = llm.generate([[5, 6, 7]], base, use_tqdm=False)[0]
    assert out.token_ids == greedy.token_ids[: cut + 1] and out.outputs[0].stop_reason == stop_id
    assert out.text == tok.decode(greedy.token_ids[:cut])
    kept = llm.generate([[5, 6, 7]], base.replace(include_stop_str_in_output=True),
                        use_tqdm=False)[0]  # fmt: skip
    assert kept.text == tok.decode(greedy.token_ids[: cut + 1])


def test_closed_llm_says_so(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu")
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("hello")


def test_workers_get_the_final_max_model_len_with_the_kv_cache(tiny_ckpt, monkeypatch, capsys):
    """The model's 512 positions do not fit in a 10-block cache: the core lowers max_model_len
    once, and the workers receive that value with the allocation, so the runner's view (its
    CUDA graphs and warm-up are built for it) equals the scheduler's and the front end's."""
    from llm_inference.executor.worker import Worker

    calls = []
    allocate = Worker.allocate_kv_cache

    def spy(self, num_blocks, max_model_len):
        calls.append((num_blocks, max_model_len))
        return allocate(self, num_blocks, max_model_len)

    monkeypatch.setattr(Worker, "allocate_kv_cache", spy)
    with LLM(str(tiny_ckpt), device="cpu", kv_cache_memory_bytes=10 * 8192) as llm:
        runner = llm.engine.executor.workers[0].model_runner
        assert calls == [(10, 160)]
        assert runner.max_model_len == llm.engine.scheduler.config.max_model_len == 160
        assert llm.config.scheduler.max_model_len == llm.engine.max_model_len == 160
        assert runner.config.scheduler.max_model_len == 512  # the bound its buffers have
    assert capsys.readouterr().out.count("max_model_len lowered from 512 to 160") == 1


def test_a_prompt_too_long_is_refused_once_by_llm_and_async_llm(tiny_ckpt, monkeypatch):
    """One length check, where the request enters (LLMEngine.add_request): LLM and AsyncLLM
    (its core in a process of its own) refuse a prompt longer than the context once, with a
    message naming the lengths; nothing reaches the core."""
    import asyncio

    from llm_inference import AsyncLLM
    from llm_inference.engine import llm_engine

    checks = []
    check = llm_engine.check_request_length

    def counted(*args):
        checks.append(args)
        return check(*args)

    monkeypatch.setattr(llm_engine, "check_request_length", counted)
    message = "the prompt has 600 tokens, which leaves no room to generate within max_model_len=512"
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        with pytest.raises(ValueError, match=f"^prompt 1: {message}$"):
            llm.generate([[5, 6], [5] * 600], max_new_tokens=2, use_tqdm=False)
        assert checks == [(512, 2, 2), (512, 600, 2)]
        assert not llm.engine.has_unfinished_requests()
        assert not llm.engine.output_processor.requests
    checks.clear()

    async def refused(llm):
        async for _ in llm.generate([5] * 600, SamplingParams(max_tokens=2)):
            pass

    with AsyncLLM(str(tiny_ckpt), device="cpu", kv_cache_memory_bytes=2 << 20) as allm:
        with pytest.raises(ValueError, match=f"^{message}$"):
            asyncio.run(refused(allm))
        assert checks == [(512, 600, 2)]
        assert allm.stats()["num_unfinished_requests"] == 0


def test_final_only_requests_are_filtered_by_the_output_processor(llm, monkeypatch):
    """The core reports a token of every request every step; a FINAL_ONLY request
    (`stream=False`, as LLM.generate adds them) gets one output, at the end, the same as the
    streamed one's last."""
    engine = llm.engine
    records = []
    step = engine.core.step

    def counted_step():
        out = step()
        records.extend(r.request_id for r in out)
        return out

    monkeypatch.setattr(engine.core, "step", counted_step)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("final", [5, 6, 7], params, stream=False)
    engine.add_request("streamed", [5, 6, 7], params)
    seen = drain(engine)
    assert records.count("final") == records.count("streamed") == 6
    assert len(seen["final"]) == 1 and len(seen["streamed"]) == 6
    final, streamed = seen["final"][0], seen["streamed"][-1]
    assert final.finished and final.outputs[0].text == streamed.outputs[0].text
    assert final.outputs[0].token_ids == streamed.outputs[0].token_ids
