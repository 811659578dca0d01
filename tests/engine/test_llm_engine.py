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
