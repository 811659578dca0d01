"""The server through the official `openai` client: both endpoints with and without streaming
(streamed text == non-streamed text for greedy requests, usage counts), logprobs formats, the
extra endpoints, and every error case with its status, after which the server still answers."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL_NAME

from llm_inference import SamplingParams

GREEDY = dict(model=MODEL_NAME, temperature=0.0, max_tokens=12, ignore_eos=True)
OFFLINE = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _extra(kw: dict) -> dict:
    """`ignore_eos` and the other vLLM fields go in extra_body."""
    kw = dict(kw)
    if "ignore_eos" in kw:
        kw["extra_body"] = {"ignore_eos": kw.pop("ignore_eos")}
    return kw


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_stream_equals_non_stream_and_usage(client, live_server, offline_llm):
    prompt = "The quick brown fox"
    full = client.completions.create(prompt=prompt, **_extra(GREEDY))
    want = offline_llm.generate(prompt, OFFLINE, use_tqdm=False)[0]
    assert full.choices[0].text == want.text
    n_prompt = len(offline_llm.tokenizer(prompt).input_ids)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, 12)
    assert full.usage.total_tokens == n_prompt + 12
    chunks = list(
        client.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **_extra(GREEDY)
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream_and_usage(client, offline_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(messages=messages, **_extra(GREEDY))
    want = offline_llm.chat(messages, OFFLINE, use_tqdm=False)[0]
    assert full.choices[0].message.content == want.text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(want.prompt_token_ids)
    assert full.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **_extra(GREEDY)
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, endpoint):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, each chunk carries the
    prompt's tokens and the completion tokens so far; the last usage chunk the totals."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "completions":
        create, kw = client.completions.create, dict(prompt="The quick brown fox")
    else:
        messages = [{"role": "user", "content": "Hi"}]
        create, kw = client.chat.completions.create, dict(messages=messages)
    chunks = list(create(stream=True, stream_options=options, **kw, **_extra(GREEDY)))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 12
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in chunks[:-1])
    assert counts == sorted(counts) and counts[-1] == 12  # (how many a chunk adds: timing)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + n for c, n in zip(chunks, counts))
    # without include_usage the option changes nothing: no usage anywhere
    plain = list(create(stream=True, stream_options={"continuous_usage_stats": True}, **kw,
                        **_extra(GREEDY)))  # fmt: skip
    assert all(c.usage is None for c in plain)


def test_logprobs_zero_gives_the_sampled_token(client):
    """logprobs=0 (the sampled token's logprob only): each top_logprobs entry is that token,
    as OpenAI's completions and vLLM give it; before, empty dicts."""
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4,
                                  temperature=0.0, logprobs=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 4
    assert [list(t.items()) for t in lp.top_logprobs] == [
        [(tok, v)] for tok, v in zip(lp.tokens, lp.token_logprobs)
    ]


def test_n_stop_seed_and_logprobs(client):
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=["Hello", "Paris is"],
        n=2,
        max_tokens=5,
        temperature=0.8,
        seed=7,
        logprobs=2,
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    # the sampled token first, then the 2 most likely (OpenAI: up to logprobs + 1 entries;
    # fewer where tokens read the same text)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and list(top.items())[0] == (token, logprob)
    again = client.completions.create(
        model=MODEL_NAME, prompt=["Hello", "Paris is"], n=2, max_tokens=5, temperature=0.8, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2},
    )
    content = chat.choices[0].logprobs.content
    assert 2 <= len(content) <= 4 and all(len(c.top_logprobs) == 3 for c in content)
    base = client.completions.create(prompt="Hello world", **_extra(GREEDY)).choices[0].text
    if len(base) > 4:
        stop = base[2:4]
        cut = client.completions.create(prompt="Hello world", stop=[stop], **_extra(GREEDY))
        assert cut.choices[0].text == base[: base.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_logit_bias_and_allowed_token_ids(client, offline_llm):
    """OpenAI's logit_bias (token ids as strings) and vLLM's allowed_token_ids reach the
    sampler: a +100 bias forces its token; sampled tokens stay in the allowed set; a key that
    is not a token id is a 400 naming the field."""
    tok = offline_llm.get_tokenizer()
    forced = tok("Paris", add_special_tokens=False).input_ids[0]
    r = client.completions.create(prompt="Hello", logit_bias={str(forced): 100}, **_extra(GREEDY))
    assert r.choices[0].text == tok.decode([forced] * 12)
    allowed = sorted(set(tok(" a b c d", add_special_tokens=False).input_ids))
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=10, temperature=1.0, seed=3, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )  # fmt: skip
    assert set(r.choices[0].logprobs.tokens) <= {tok.decode([t]) for t in allowed}
    with pytest.raises(openai.BadRequestError, match="logit_bias keys must be token ids"):
        client.completions.create(prompt="Hello", logit_bias={"x": 1}, **_extra(GREEDY))
    with pytest.raises(openai.BadRequestError, match="logit_bias must be"):
        client.completions.create(prompt="Hello", logit_bias={"5": 101}, **_extra(GREEDY))
    # bad_words reach the engine: a one-token word of the greedy output is gone from it
    (plain,) = offline_llm.generate(["Hello"], OFFLINE, use_tqdm=False)
    words = [tok.decode([t]) for t in plain.token_ids]
    word, token = next(
        (w, t) for w, t in zip(words, plain.token_ids)
        if w.strip().isalpha() and tok.encode(w, add_special_tokens=False) == [t]
    )  # fmt: skip
    banned = client.completions.create(
        prompt="Hello", logprobs=0, extra_body={"bad_words": [word], "ignore_eos": True},
        **{k: v for k, v in GREEDY.items() if k != "ignore_eos"},
    )  # fmt: skip
    assert banned.choices[0].text != plain.text and word not in banned.choices[0].logprobs.tokens


def test_echo_and_prompt_logprobs(client, offline_llm):
    """Completions' echo (the prompt's text, and with logprobs its tokens' logprobs first) and
    vLLM's prompt_logprobs field (per choice for completions, at the top for chat), equal to
    the offline engine's prompt logprobs; echo with stream is a 400."""
    plain = client.completions.create(prompt="Hello world", **_extra(GREEDY))
    r = client.completions.create(prompt="Hello world", echo=True, logprobs=2, **_extra(GREEDY))
    choice = r.choices[0]
    assert choice.text == "Hello world" + plain.choices[0].text
    (want,) = offline_llm.generate(["Hello world"], OFFLINE.replace(prompt_logprobs=2),
                                   use_tqdm=False)  # fmt: skip
    n = len(want.prompt_token_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n + 12
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(
        [x.logprob for x in want.prompt_logprobs[1:]], abs=1e-4
    )
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 3 and list(top.items())[0] == (token, logprob)
    assert lp.text_offset == sorted(lp.text_offset)
    r = client.completions.create(
        prompt="Hello world", extra_body={"prompt_logprobs": 1, "ignore_eos": True},
        **{k: v for k, v in GREEDY.items() if k != "ignore_eos"},
    )  # fmt: skip
    got = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == n
    for entry, x in zip(got[1:], want.prompt_logprobs[1:]):
        assert entry[str(x.token_id)]["logprob"] == pytest.approx(x.logprob, abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    chat_lps = chat.model_dump()["prompt_logprobs"]
    assert chat_lps[0] is None and len(chat_lps) > 2 and all(len(e) == 1 for e in chat_lps[1:])
    with pytest.raises(openai.BadRequestError, match="echo is not supported with stream"):
        client.completions.create(prompt="Hello", echo=True, stream=True, **_extra(GREEDY))
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs is not supported with"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], stream=True,
            extra_body={"prompt_logprobs": 0},
        )  # fmt: skip


def test_structured_output_choice(client):
    """vLLM's structured_outputs {"choice": [...]} and the older guided_choice: the answer is
    one of the choices."""
    choices = ["red", "green", "blue sky"]
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Color?"}], max_tokens=8)
    r = client.chat.completions.create(extra_body={"structured_outputs": {"choice": choices}},
                                       **chat)  # fmt: skip
    assert r.choices[0].message.content in choices
    r = client.completions.create(model=MODEL_NAME, prompt="Color:", max_tokens=8, n=3,
                                  temperature=1.0, seed=5,
                                  extra_body={"guided_choice": choices})  # fmt: skip
    assert {c.text for c in r.choices} <= set(choices)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"]}  # fmt: skip
NO_WS = {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}
PET = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"]}


def no_whitespace_bias(tokenizer) -> dict[str, float]:
    """A logit_bias that all but bans whitespace tokens: with whitespace allowed between JSON
    tokens (the default), a random model's answer is otherwise mostly whitespace."""
    blank = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isspace()]
    return {str(i): -100.0 for i in blank}


def _stream_text(chunks) -> tuple[str, str]:
    """(text, last finish_reason) of a streamed completion or chat answer."""
    text, reason = "", None
    for c in chunks:
        for choice in c.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else choice.text
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_every_way_to_ask_for_structured_outputs(client, live_server, stream):
    """OpenAI's response_format (json_schema with strict, json_object), vLLM's
    structured_outputs and its older guided_* fields, on both endpoints, streamed or not: the
    answers, random at temperature 1, pass their validators."""
    jsonschema = pytest.importorskip("jsonschema")
    bias = no_whitespace_bias(live_server.llm.tokenizer)
    regex, grammar = r"[a-c]{2,4}-\d{1,2}", 'root ::= "(" [1-9] [0-9]? ")"'
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "pet", "schema": PET, "strict": True}}, logit_bias=bias),
         lambda t: jsonschema.validate(json.loads(t), PET)),
        (dict(extra_body=NO_WS), lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (dict(extra_body={"guided_json": json.dumps(PERSON)}, logit_bias=bias),
         lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (dict(extra_body={"structured_outputs": {"regex": regex}}),
         lambda t: re.fullmatch(regex, t) or pytest.fail(t)),
        (dict(extra_body={"guided_regex": regex}),
         lambda t: re.fullmatch(regex, t) or pytest.fail(t)),
        (dict(extra_body={"structured_outputs": {"grammar": grammar}}),
         lambda t: re.fullmatch(r"\([1-9]\d?\)", t) or pytest.fail(t)),
        (dict(extra_body={"guided_grammar": grammar}),
         lambda t: re.fullmatch(r"\([1-9]\d?\)", t) or pytest.fail(t)),
        (dict(response_format={"type": "structural_tag", "format": {
            "type": "sequence", "elements": [{"type": "const_string", "value": "<n>"},
                                             {"type": "regex", "pattern": "[1-9]{1,2}"},
                                             {"type": "const_string", "value": "</n>"}]}}),
         lambda t: re.fullmatch(r"<n>[1-9]{1,2}</n>", t) or pytest.fail(t)),
    ]  # fmt: skip
    for i, (kw, check) in enumerate(cases):
        kw = {"model": MODEL_NAME, "temperature": 1.0, "seed": i, "max_tokens": 60,
              "stream": stream, **kw}  # fmt: skip
        for endpoint in ("chat", "completions"):
            if endpoint == "chat":
                r = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                                   **kw)  # fmt: skip
            else:  # response_format is vLLM's on completions: not in the client's arguments
                body = {
                    **kw.get("extra_body", {}),
                    **(
                        {"response_format": kw["response_format"]}
                        if "response_format" in kw
                        else {}
                    ),
                }
                plain = {k: v for k, v in kw.items() if k not in ("response_format", "extra_body")}
                r = client.completions.create(prompt="Data:", extra_body=body, **plain)
            if stream:
                text, reason = _stream_text(r)
            else:
                choice = r.choices[0]
                text = choice.message.content if endpoint == "chat" else choice.text
                reason = choice.finish_reason
            assert reason == "stop", (kw, text)
            check(text)
    # json_object: any JSON object or array (random keys: only the finished answers parse)
    rs = [client.completions.create(model=MODEL_NAME, prompt="Data:", max_tokens=40, seed=s,
                                    extra_body={"response_format": {"type": "json_object"}},
                                    stream=stream, logit_bias=bias)
          for s in range(4)]  # fmt: skip
    done = [t for t, reason in map(_stream_text, rs) if reason == "stop"] if stream else [
        r.choices[0].text for r in rs if r.choices[0].finish_reason == "stop"]  # fmt: skip
    assert done and all(isinstance(json.loads(t), (dict, list)) for t in done)


def test_structured_output_errors_name_the_field(client):
    """A spec xgrammar cannot take is a 400 naming the field it came in and the problem; so are
    two fields at once and a response_format this server does not have."""
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    cases = [
        (dict(response_format=bad_schema), "response_format",
         'response_format.json_schema.schema: Unsupported type "foo"'),
        (dict(extra_body={"structured_outputs": {"json": {"type": "array", "contains": {}}}}),
         "structured_outputs", "structured_outputs.json: `contains` at # is not supported"),
        (dict(extra_body={"guided_regex": "(a"}), "guided_regex",
         "guided_regex: Regex parsing error"),
        (dict(extra_body={"guided_json": "{oops"}), "guided_json", "guided_json is not JSON"),
        (dict(extra_body={"structured_outputs": {"grammar": "root ::= nope"}}),
         "structured_outputs", 'structured_outputs.grammar: EBNF parser error'),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
         "response_format", "guided_regex and response_format both ask for structured"),
        (dict(response_format={"type": "json_schema"}), "response_format",
         "response_format json_schema needs json_schema"),
        (dict(response_format={"type": "xml"}), "response_format",
         "response_format type 'xml' is not supported"),
        (dict(response_format={"type": "structural_tag"}), "response_format",
         "response_format: "),
        (dict(extra_body={"structured_outputs": {"regex": "a", "min_tokens": 1}}),
         "structured_outputs", "structured_outputs: unknown keys ['min_tokens']"),
    ]  # fmt: skip
    for kw, param, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**chat, **kw)
        err = info.value.body
        assert err["param"] == param and err["message"].startswith(message), (kw, err)
    r = client.completions.create(model=MODEL_NAME, prompt="Data:", max_tokens=3, seed=1,
                                  extra_body=NO_WS)  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith("{")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}  # fmt: skip


def _streamed_calls(chunks) -> tuple[list[dict], str]:
    """Tool calls accumulated from a stream's deltas (by index, arguments concatenated), and
    the last finish_reason."""
    calls: dict[int, dict] = {}
    reason = None
    for c in chunks:
        for choice in c.choices:
            assert not choice.delta.content
            for t in choice.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": t.id, "name": t.function.name,
                                                  "arguments": ""})  # fmt: skip
                call["arguments"] += t.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_give_calls(client, stream):
    """tool_choice "required": one call or more (one with parallel_tool_calls false), each to
    one of the tools with arguments of its schema ($defs and all); a named function: a call to
    it. Streamed as vLLM streams them (a named call's arguments in pieces, "required" calls as
    they complete); finish_reason "tool_calls"."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, stream=stream)  # fmt: skip
    named = {"type": "function", "function": {"name": "get_time"}}
    seen, most = set(), 0
    for seed, choice, parallel in [(0, "required", False), (3, "required", True),
                                   (2, "required", False), (1, named, True)]:  # fmt: skip
        r = client.chat.completions.create(tool_choice=choice, seed=seed,
                                           parallel_tool_calls=parallel, **chat)  # fmt: skip
        if stream:
            calls, reason = _streamed_calls(r)
        else:
            message, reason = r.choices[0].message, r.choices[0].finish_reason
            assert message.content is None
            calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                     for t in message.tool_calls]  # fmt: skip
        assert reason == "tool_calls" and calls
        for call in calls:
            assert call["id"].startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
            seen.add(call["name"])
        if choice is named:
            assert [c["name"] for c in calls] == ["get_time"]
        assert parallel or len(calls) == 1
        most = max(most, len(calls))
    assert seen == {"get_weather", "get_time"} and most > 1
    for choice, message in [
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice names 'nope', which"),
        ("anything", "tool_choice must be 'auto', 'none', 'required' or"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(tool_choice=choice, **chat)
    with pytest.raises(openai.BadRequestError, match="tool_choice 'required' needs tools"):
        client.chat.completions.create(tool_choice="required", **{**chat, "tools": None})


def test_tool_calls(client):
    """With `tools`, an answer that is a Llama 3 tool call (forced here with guided_choice)
    comes back as `tool_calls` with finish_reason "tool_calls"; a conversation with tool turns
    is accepted; tool_choice "none" leaves the text alone; streamed alike; what is not
    supported is a 400."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    chat = dict(model=MODEL_NAME, max_tokens=100, tools=[tool],
                messages=[{"role": "user", "content": "Weather in Paris?"}])  # fmt: skip
    r = client.chat.completions.create(extra_body={"guided_choice": [call]}, **chat)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    (item,) = message.tool_calls
    assert item.function.name == "get_weather"
    assert json.loads(item.function.arguments) == {"city": "Paris"}
    follow_up = chat["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [item.model_dump()]},
        {"role": "tool", "tool_call_id": item.id, "content": "sunny"},
    ]
    r = client.chat.completions.create(**{**chat, "messages": follow_up, "max_tokens": 3})
    assert r.choices[0].message.tool_calls is None
    r = client.chat.completions.create(tool_choice="none", extra_body={"guided_choice": [call]},
                                       **chat)  # fmt: skip
    assert r.choices[0].message.content == call and not r.choices[0].message.tool_calls
    # streamed: the call as one tool_calls delta, never as content; plain answers as text
    chunks = list(client.chat.completions.create(stream=True, extra_body={"guided_choice": [call]},
                                                 **chat))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
    (streamed,) = [t for d in deltas for t in d.tool_calls or []]
    assert streamed.index == 0 and streamed.id and streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    for text in ("Sunny in Paris", '{"forecast": "sunny"}'):
        chunks = client.chat.completions.create(
            stream=True, extra_body={"guided_choice": [text]}, **chat
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_truncate_prompt_tokens(client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens only, past max_model_len too."""
    r = client.completions.create(
        model=MODEL_NAME, prompt="Hello " * 600, max_tokens=3,
        extra_body={"truncate_prompt_tokens": 7},
    )  # fmt: skip
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 3


def test_tokenize_detokenize_health_metrics(live_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tok = httpx.post(
        live_server.url + "/tokenize", json={"prompt": "Hello world"}, headers=headers
    ).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(
        live_server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=headers
    ).json()["prompt"]
    assert text.endswith("Hello world")
    assert httpx.get(live_server.url + "/health").status_code == 200
    page = httpx.get(live_server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_sum",
        "request_queue_time_seconds_count",
    ):
        assert f"vllm:{name}" in page


def _counter(live_server, name: str) -> float:
    page = httpx.get(live_server.url + "/metrics").text
    line = next(x for x in page.splitlines() if x.startswith(f"vllm:{name}{{"))
    return float(line.split()[-1])


def test_prompt_tokens_counted_per_sequence(client, live_server):
    """vllm:prompt_tokens_total counts a prompt of n sequences n times, as vLLM does (each
    sequence runs it); usage counts it once, as OpenAI does."""
    before = _counter(live_server, "prompt_tokens_total")
    r = client.completions.create(model=MODEL_NAME, prompt="Hello world", n=3, max_tokens=2,
                                  temperature=0.8, seed=1)  # fmt: skip
    after = _counter(live_server, "prompt_tokens_total")
    assert after - before == 3 * r.usage.prompt_tokens > 0


BAD = [
    ("temperature", dict(temperature=-1.0), 400, "temperature must be"),
    ("n", dict(n=0), 400, "n must be an integer >= 1"),
    ("prompt too long", dict(prompt="Hello " * 600), 400, "max_model_len=512"),
    ("max_tokens", dict(max_tokens=0), 400, "max_tokens must be"),
    ("type", dict(top_p="lots"), 400, "top_p"),
    ("model", dict(model="gpt-9"), 404, "`gpt-9` does not exist"),
    (
        "guided_json",
        dict(extra_body={"guided_json": {"type": "object", "if": {}}}),
        400,
        "guided_json: `if` at # is not supported",
    ),
    ("best_of", dict(extra_body={"best_of": 3}), 400, "best_of is not supported"),
    (
        "beam search with logprobs",
        dict(logprobs=2, extra_body={"use_beam_search": True}),
        400,
        "use_beam_search does not take logprobs",
    ),
    (
        "beam search, prompt too long",
        dict(prompt="Hello " * 600, extra_body={"use_beam_search": True}),
        400,
        "max_model_len=512",
    ),
]


def test_beam_search(client, offline_llm):
    """vLLM's use_beam_search: the n best beams of LLM.beam_search on the same model, best
    first, streamed or not (the stream sends them when the search ends)."""
    from llm_inference import BeamSearchParams

    prompt = "The quick brown fox"
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=3, temperature=0.0,
              extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    (want,) = offline_llm.beam_search(prompt, BeamSearchParams(3, 4, ignore_eos=True))
    start = len(offline_llm.tokenizer(prompt).input_ids)
    texts = [offline_llm.tokenizer.decode(b.tokens[start:], skip_special_tokens=True)
             for b in want.sequences]  # fmt: skip
    r = client.completions.create(**kw)
    got = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert got == texts and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12
    streamed = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}],
        **{k: v for k, v in kw.items() if k != "prompt"},
    )
    assert len(chat.choices) == 3 and len({c.message.content for c in chat.choices}) == 3


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name,kw,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_server_still_answers(client, name, kw, status, message, stream):
    args = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "stream": stream, **kw}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    err = info.value.body
    assert message in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices


def test_unsupported_chat_fields_are_refused_not_ignored(client):
    """A request for functions gets a 400 naming the field (an answer that ignored it would
    look valid); off values, as clients send them, are accepted."""
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    function = {"name": "f", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError, match="functions is not supported"):
        client.chat.completions.create(functions=[function], **chat)
    ok = client.chat.completions.create(response_format={"type": "text"}, tool_choice="none",
                                        **chat)  # fmt: skip
    assert ok.choices[0].message.content is not None


def test_chat_continue_final_message(client):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=msgs, max_tokens=3,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "chat_template_kwargs": {"unused": 1}},
    )  # fmt: skip
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="continue_final_message needs"):
        client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=3,
                                       extra_body={"continue_final_message": True})  # fmt: skip


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], top_logprobs=2
        )
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hello " * 600}], stream=True
        )


def test_auth_and_body_limit(live_server, client):
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(
            live_server.v1 + "/completions",
            headers=headers,
            json={"model": MODEL_NAME, "prompt": "x"},
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=live_server.v1, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        bad.models.list()
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x" * (9 << 20), max_tokens=2)
    assert info.value.status_code == 413
    assert "exceeds the limit" in info.value.body["message"]
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
