"""Structured outputs end to end on the tiny random model (CPU): at temperature 1 its answers
are random, yet each kind's answer passes its validator (jsonschema, re.fullmatch, membership);
a constrained request leaves the others' tokens alone; its answer survives preemption and
recompute and async scheduling unchanged (with rows on the host path, preempted and refilled);
under async scheduling a constrained step's forward is launched before the step before's tokens
are read, and its sampling after; an abort mid-answer leaves the others' answers alone; a
grammar that is still compiling holds up no other request and can be aborted; a spec xgrammar
cannot take is a ValueError naming it; an answer that does not fit in max_tokens ends with
"length"."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
from helpers import answers

from llm_inference import LLM, SamplingParams
from llm_inference import StructuredOutputsParams as S
from llm_inference.structured_output import manager as manager_module

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "likes": {"type": "array", "items": {"type": "boolean"}, "maxItems": 1},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-\d{1,3}"
GRAMMAR = 'root ::= num (" + " num)?\nnum ::= [1-9] [0-9]?'
CHOICES = ["yes please", "no", "maybe later", 'say "hi"']
# xgrammar's structural tag: "<a>", a JSON object of POINT, "</a>"
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["x"], "additionalProperties": False}  # fmt: skip
TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<a>"},
    {"type": "json_schema", "json_schema": POINT},
    {"type": "const_string", "value": "</a>"}]}}  # fmt: skip


def valid_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def valid_tag(text: str) -> None:
    inner = re.fullmatch(r"<a>(.*)</a>", text, re.S) or pytest.fail(text)
    jsonschema.validate(json.loads(inner.group(1)), POINT)


# (spec, validator): every answer of these fits in max_tokens, so every one must end on EOS
KINDS = {
    "json": (S(json=PERSON, disable_any_whitespace=True), valid_person),
    "regex": (S(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "grammar": (
        S(grammar=GRAMMAR),
        lambda t: re.fullmatch(r"[1-9]\d?( \+ [1-9]\d?)?", t) or pytest.fail(t),
    ),  # fmt: skip
    "choice": (S(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
    "structural_tag": (S(structural_tag=TAG), valid_tag),
}
PROMPTS = ["The quick brown", "Paris is the capital", "Hello world! How are", "One two"]


def constrained(kind: str, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=64,
                          structured_outputs=KINDS[kind][0], **kw)  # fmt: skip


def plain(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=100 + seed, max_tokens=16, ignore_eos=True)


def mixed_batch(kinds=tuple(KINDS), seeds=range(3)) -> tuple[list[str], list[SamplingParams]]:
    """Every kind at several seeds (the first with n=2), between unconstrained requests."""
    prompts, params = [], []
    for i, kind in enumerate(kinds):
        for seed in seeds:
            prompts.append(PROMPTS[(i + seed) % len(PROMPTS)])
            params.append(constrained(kind, seed, n=2 if seed == seeds[0] else 1))
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(plain(i))
    return prompts, params


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu") as llm:  # async scheduling: the default
        yield llm


@pytest.fixture(scope="module")
def mixed(llm):
    prompts, params = mixed_batch()
    return answers(llm.generate(prompts, params, use_tqdm=False))


def test_every_kind_passes_its_validator(mixed):
    prompts, params = mixed_batch()
    checked = 0
    for p, outs in zip(params, mixed):
        if p.structured_outputs is None:
            continue
        check = next(v for so, v in KINDS.values() if so == p.structured_outputs)
        for _, text, reason in outs:
            assert reason == "stop", text
            check(text)
            checked += 1
    assert checked == len(KINDS) * 4
    texts = {
        text
        for p, outs in zip(params, mixed)
        for _, text, _ in outs
        if p.structured_outputs is not None and p.structured_outputs.json is not None
    }
    assert len(texts) == 4  # random answers, all different


def test_unconstrained_requests_keep_their_tokens(llm, mixed):
    """Beside constrained requests (their steps one at a time, a bitmask in the batch) the other
    requests draw exactly the tokens they draw alone (overlapped steps, no bitmask)."""
    prompts, params = mixed_batch()
    alone = [(pr, p) for pr, p in zip(prompts, params) if p.structured_outputs is None]
    outs = answers(llm.generate([a[0] for a in alone], [a[1] for a in alone], use_tqdm=False))
    assert outs == [o for p, o in zip(params, mixed) if p.structured_outputs is None]


def test_answers_with_async_scheduling_equal_those_without(tiny_ckpt, llm, mixed):
    """Overlapped constrained steps (the forward of step n+1, then its sampling once step n's
    tokens are in the matchers) draw token for token what steps one at a time draw: every kind,
    n=2, beside unconstrained requests, with rows on the host path (a logit bias, min_tokens;
    float32 logits) and, while it lives, a constrained request with logprobs (which runs every
    step one at a time)."""
    prompts, params = mixed_batch()
    more = [constrained("choice", 5, logprobs=2), constrained("regex", 6, logit_bias={97: 3.0}),
            plain(7).replace(min_tokens=20, max_tokens=24, ignore_eos=False)]  # fmt: skip
    outs = llm.generate(PROMPTS[:3], more, use_tqdm=False)
    with LLM(str(tiny_ckpt), device="cpu", async_scheduling=False) as sync:
        assert answers(sync.generate(prompts, params, use_tqdm=False)) == mixed
        want = sync.generate(PROMPTS[:3], more, use_tqdm=False)
    assert answers(outs) == answers(want)
    logprobs = outs[0].outputs[0].logprobs
    assert logprobs == want[0].outputs[0].logprobs and len(logprobs[0].top) == 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_same_answers_under_preemption_and_recompute(tiny_ckpt, llm, async_scheduling):
    """An engine whose cache holds a few requests preempts them mid-answer and recomputes
    them: their grammars go on from every token they kept, and the answers are token for token
    those of an engine that never preempts."""
    prompts, params = mixed_batch(("json", "choice"), range(2))
    want = answers(llm.generate(prompts, params, use_tqdm=False))
    small = dict(block_size=4, kv_cache_memory_bytes=24 * 2048, max_model_len=96)
    with LLM(str(tiny_ckpt), device="cpu", async_scheduling=async_scheduling, **small) as other:
        assert answers(other.generate(prompts, params, use_tqdm=False)) == want
        assert other.stats()["num_preemptions"] > 0


def test_rows_on_the_host_path_through_preemption_and_refill(tiny_ckpt):
    """Overlapped constrained steps with rows on the host path (a logit bias, min_tokens), in
    a small cache that preempts them and few rows that refill as requests end: the answers of
    steps one at a time, token for token."""
    prompts, params = [], []
    for i in range(8):
        kind = ("json", "regex", "choice")[i % 3]
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(constrained(kind, i, logit_bias={97 + i: 4.0}) if i % 4 != 3 else
                      plain(i).replace(max_tokens=12 + i, min_tokens=8))  # fmt: skip
    small = dict(block_size=4, kv_cache_memory_bytes=24 * 2048, max_model_len=96, max_num_seqs=3)
    got = {}
    for async_scheduling in (True, False):
        kw = dict(device="cpu", async_scheduling=async_scheduling, **small)
        with LLM(str(tiny_ckpt), **kw) as llm:
            got[async_scheduling] = answers(llm.generate(prompts, params, use_tqdm=False))
            assert llm.stats()["num_preemptions"] > 0
    assert got[True] == got[False]


def test_a_constrained_step_is_launched_before_the_step_before_is_read(llm, monkeypatch):
    """Async scheduling: a step with constrained rows goes out as its forward, launched before
    step n's tokens are read (the host's update and bitmask overlap the device's forward), then
    its sampling, with the bitmask filled from them, and in the same call the next step's
    launch (the device does not wait for the caller between them). A request that step n's
    token finished still has its row sampled there, with every token allowed."""
    core = llm.engine.core
    events, finished = [], []  # finished: the bitmask rows of requests finished since

    def record(obj, name, event):
        real = getattr(obj, name, None)

        def call(*args, **kw):
            events.append(event(*args, **kw))
            return real(*args, **kw)

        monkeypatch.setattr(obj, name, call, raising=False)

    record(
        core.executor,
        "execute_model",
        lambda so, sync=True, sample=True: ("step" if sample else "forward", so.step_id),
    )
    record(core.executor, "sample_tokens", lambda bitmask: ("sample", None))
    record(core.scheduler, "update_from_output", lambda so, out: ("update", so.step_id))
    fill = core.structured.fill_bitmask

    def fill_bitmask(ids, requests):
        bitmask = fill(ids, requests)
        # copies: the bitmask is the worker's staging buffer, which the next fill overwrites
        finished.extend(bitmask[k].copy() for k, rid in enumerate(ids) if rid not in requests)
        return bitmask

    monkeypatch.setattr(core.structured, "fill_bitmask", fill_bitmask)
    step = core.step

    def step_returning():
        outputs = step()
        events.append(("returned", None))
        return outputs

    monkeypatch.setattr(core, "step", step_returning)
    prompts, params = mixed_batch(("json", "regex"), range(2))
    for out, p in zip(llm.generate(prompts, params, use_tqdm=False), params):
        if p.structured_outputs is not None:
            assert out.outputs[0].finish_reason == "stop"
    sampled = [i for i, (kind, _) in enumerate(events) if kind == "sample"]
    launched_next = [events[i + 1][0] in ("forward", "step") for i in sampled]
    assert sum(launched_next) >= len(sampled) - 1, events  # all but the last one
    events = [e for e in events if e[0] != "returned"]
    overlapped = 0
    for i, (kind, step_id) in enumerate(events):
        if kind != "forward":
            continue
        after = events[i + 1 : i + 3]
        if after[0][0] == "update":  # the step before, read after this one's forward
            assert after[0][1] < step_id and after[1] == ("sample", None)
            overlapped += 1
        else:
            assert after[0] == ("sample", None)
    assert overlapped >= 20
    assert finished and all((row == -1).all() for row in finished)


def test_the_bitmask_is_filled_in_the_workers_staging_buffer(llm, monkeypatch):
    """With the worker in the engine core's process, each step's bitmask is filled in the
    buffer it goes to the device from (nothing packed), and the answers stay valid."""
    core = llm.engine.core
    staging = core.executor.workers[0].model_runner.mask_staging
    fills = []
    fill = core.structured.fill_bitmask

    def recorded(ids, requests):
        fills.append(fill(ids, requests))
        return fills[-1]

    monkeypatch.setattr(core.structured, "fill_bitmask", recorded)
    check = KINDS["json"][1]
    out = llm.generate(PROMPTS[:2], [constrained("json", s) for s in range(2)], use_tqdm=False)
    assert fills and all(np.shares_memory(b, staging.host.numpy()) for b in fills)
    for o in out:
        if o.outputs[0].finish_reason == "stop":
            check(o.outputs[0].text)


def test_a_call_reports_each_request_once(llm, monkeypatch):
    """A call that reads two steps (a constrained step's sampling, then the step after it,
    unconstrained or empty) reports one record per request, holding both steps' tokens:
    front ends read a request once per call (the server's streamed deltas lost a token to a
    second record in one call). Such a call comes when the last constrained request has
    finished and an unconstrained one runs on: short choices beside 64 plain tokens, their
    grammars compiled (cached) beforehand, so that on a loaded machine too they run along."""
    core, calls = llm.engine.core, []
    step = core.step
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    long_plain = SamplingParams(temperature=1.0, seed=100, max_tokens=64, ignore_eos=True)
    params = [constrained("choice", 0), constrained("choice", 1), long_plain]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # xgrammar caches the compiled grammar

    def recording():
        records = step()
        calls.append(records)
        return records

    monkeypatch.setattr(core, "step", recording)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens: dict[str, list[int]] = {}
    for records in calls:
        assert len({r.request_id for r in records}) == len(records)
        for r in records:
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
    assert any(len(r.new_token_ids) > 1 for records in calls for r in records)  # it arose
    got = sorted(c.token_ids for o in outs for c in o.outputs)
    assert sorted(tokens.values()) == got


def test_one_record_each_keeps_order_logprobs_and_the_end():
    from llm_inference.core.outputs import EngineCoreOutput as R
    from llm_inference.engine.engine_core import one_record_each

    first = [R("a", [1], new_logprobs=["l1"], prompt_logprobs=[None, "p"]), R("b", [5])]
    second = [R("c", [7]), R("a", [2, 3], "stop", 3, ["l2", "l3"], None, [1, 2, 3])]
    merged = {r.request_id: r for r in one_record_each(first, second)}
    assert list(merged) == ["a", "b", "c"]
    assert merged["a"] == R("a", [1, 2, 3], "stop", 3, ["l1", "l2", "l3"], [None, "p"], [1, 2, 3])
    assert merged["b"] is first[1] and merged["c"] is second[0]
    assert one_record_each([], second) is second and one_record_each(first, []) is first


def test_a_constrained_request_joining_overlapped_steps(llm):
    """Async scheduling: a constrained request added while an overlapped step is in flight (its
    tokens not yet read) gets masks from every token before them: its answer is valid, the
    running requests' tokens are those they draw alone, and the steps stay overlapped."""
    engine = llm.engine
    alone = answers(llm.generate(PROMPTS[:2], [plain(0), plain(1)], use_tqdm=False))
    engine.add_request("p0", llm.tokenizer(PROMPTS[0]).input_ids, plain(0))
    engine.add_request("p1", llm.tokenizer(PROMPTS[1]).input_ids, plain(1))
    outs: dict[str, list] = {}
    for _ in range(3):
        assert engine.core._pending is not None or not outs  # overlapped: a step in flight
        for o in engine.step():
            outs[o.request_id] = o
    engine.add_request("c", llm.tokenizer(PROMPTS[2]).input_ids, constrained("json", 7))
    constrained_in_flight = 0  # steps that returned with a constrained step in flight
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        pending = engine.core._pending
        constrained_in_flight += bool(pending and pending[0].structured_output_request_ids)
    valid_person(outs["c"].outputs[0].text)
    assert answers([outs["p0"], outs["p1"]]) == alone
    assert constrained_in_flight > 5


def test_abort_mid_answer_leaves_the_others_alone(llm):
    """Abort a constrained request while an overlapped step samples it: the others' answers are
    those they give without it, and nothing of it is left."""
    engine = llm.engine
    params = [constrained("json", 1), constrained("regex", 2), plain(3)]
    alone = answers(llm.generate(PROMPTS[1:3], params[1:], use_tqdm=False))
    for rid, prompt, p in zip("abc", PROMPTS, params):
        engine.add_request(rid, llm.tokenizer(prompt).input_ids, p)
    outs: dict[str, list] = {}
    request = engine.scheduler.requests["a"]
    while len(request.output_token_ids) < 4:
        for o in engine.step():
            outs[o.request_id] = o
    pending = engine.core._pending  # an overlapped step that samples "a"
    assert pending is not None and "a" in pending[0].structured_output_request_ids
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert answers([outs["b"], outs["c"]]) == alone
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert engine.scheduler._in_flight == {}


def test_answer_cut_by_max_tokens_ends_with_length(llm):
    (out,) = llm.generate(PROMPTS[:1], constrained("json", 0).replace(max_tokens=4),
                          use_tqdm=False)  # fmt: skip
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4 and c.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(c.text)


def test_a_spec_xgrammar_cannot_take_is_refused_naming_it(llm):
    bad = SamplingParams(structured_outputs=S(json={"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True}}}))  # fmt: skip
    with pytest.raises(ValueError, match=r"structured_outputs.json: `uniqueItems` at "
                                         r"#/properties/tags is not supported"):  # fmt: skip
        llm.generate(PROMPTS[:1], bad, use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex: Regex parsing error"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=S(regex="a(")),
                     use_tqdm=False)  # fmt: skip
    bad_tag = S(structural_tag={"type": "structural_tag", "format": {"type": "nope"}})
    with pytest.raises(ValueError, match="structured_outputs.structural_tag: .*nope"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=bad_tag), use_tqdm=False)
    old_form = S(structural_tag={"structures": [{"begin": "<f>"}], "triggers": ["<f"]})
    with pytest.raises(ValueError, match="structural_tag: .*begin, schema, end"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=old_form), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (ok,) = llm.generate(PROMPTS[:1], constrained("choice", 1), use_tqdm=False)
    assert ok.outputs[0].text in CHOICES


@pytest.fixture
def slow_compiles(monkeypatch):
    """Compiles wait for the event returned (or raise, once it is set with .fail = True)."""
    gate = threading.Event()
    gate.fail = False
    real = manager_module.compile_grammar

    def compile_grammar(compiler, key):
        assert gate.wait(30)
        if gate.fail:
            raise RuntimeError("compiler exploded")
        return real(compiler, key)

    monkeypatch.setattr(manager_module, "compile_grammar", compile_grammar)
    yield gate
    gate.set()


def test_a_compiling_grammar_holds_up_no_one_and_can_be_aborted(llm, slow_compiles):
    engine = llm.engine
    regex = S(regex=r"[0-9]{3}")  # a spec not compiled before: no cache hit
    engine.add_request("slow", [5, 6, 7], SamplingParams(structured_outputs=regex, seed=1))
    engine.add_request("plain", [5, 6, 7], plain(0))
    finished = []
    while "plain" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert engine.scheduler.requests["slow"].num_computed_tokens == 0  # never scheduled
    assert [r.request_id for r in engine.scheduler.waiting] == ["slow"]
    engine.abort_request("slow")
    assert not engine.has_unfinished_requests()
    slow_compiles.set()
    out = llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=regex), use_tqdm=False)
    assert re.fullmatch(r"[0-9]{3}", out[0].outputs[0].text)


def test_a_grammar_that_fails_to_compile_finishes_its_request(llm, slow_compiles, capsys):
    slow_compiles.fail = True
    slow_compiles.set()
    so = S(grammar='root ::= "never compiled"')
    out, other = llm.generate(PROMPTS[:2], [SamplingParams(structured_outputs=so), plain(1)],
                              use_tqdm=False)  # fmt: skip
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert "grammar failed: compiler exploded" in capsys.readouterr().out
    assert other.outputs[0].finish_reason == "length"
    assert not llm.engine.has_unfinished_requests()
