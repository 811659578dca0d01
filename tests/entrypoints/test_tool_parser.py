"""Tool calls in an answer (tool_parser.py, as vLLM's parsers): Llama 3's JSON (llama3_json)
and the <tool_call> blocks of Qwen and Hermes (hermes), whole and streamed (DeltaTracker); the
hermes parser behind a live server (`serve --tool-call-parser hermes`)."""

from __future__ import annotations

import json
import random
import re

import pytest
from conftest import serving

from llm_inference.entrypoints.openai.tool_parser import (
    get_tool_parser,
    parse_tool_calls,
    tool_call_items,
)

CALLS = [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ('  <|python_tag|>{"name": "f", "arguments": {}}\n', [("f", {})]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": "y"}}',
     [("f", {}), ("g", {"x": "y"})]),
    ('{"name": "f"}', [("f", {})]),
]  # fmt: skip
NOT_CALLS = [
    "Hello",
    'Sure: {"name": "f"}',
    '{"name": 1}',
    "[1, 2]",
    '{"name": "f", "p',
    '{"name": "f", "parameters": {}} and more',
    '{"name": "f", "parameters": [1]}',
    "",
]


@pytest.mark.parametrize("text,want", CALLS)
def test_tool_calls_are_parsed(text, want):
    assert parse_tool_calls(text) == want
    items = tool_call_items(want)
    assert [i["function"]["name"] for i in items] == [n for n, _ in want]
    assert [json.loads(i["function"]["arguments"]) for i in items] == [a for _, a in want]
    assert len({i["id"] for i in items}) == len(items) and all(i["type"] == "function"
                                                                for i in items)  # fmt: skip


@pytest.mark.parametrize("text", NOT_CALLS)
def test_other_answers_are_text(text):
    assert parse_tool_calls(text) is None


# ---- streaming (responses.DeltaTracker) -------------------------------------------------


def _stream(pieces: list[str], logprobs: bool = False, parser: str = "llama3_json") -> list[dict]:
    """The chat chunks a tools request streams for one answer arriving in `pieces`."""
    from llm_inference.entrypoints.openai.responses import DeltaTracker, ResponseBuilder
    from llm_inference.outputs import CompletionOutput, Logprobs, RequestOutput

    class Tok:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    builder = ResponseBuilder("chat", "m", Tok(), n=1)
    builder.tool_parser = get_tool_parser(parser)
    tracker, chunks = DeltaTracker(builder), []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        lps = [Logprobs(k, -0.5)] if logprobs else None
        c = CompletionOutput(0, piece, [k], "stop" if last else None, lps)
        chunks += tracker.chunks(0, RequestOutput("r", None, [1, 2], [c], last))
    return [ch["choices"][0] for ch in chunks]


@pytest.mark.parametrize("pieces", [
    ['{"name": "f", ', '"parameters": {"a": 1}}'],
    ["  <|py", "thon_tag|>", '{"name": "f", "arguments": {"a": 1}}'],
    ['{"name": "f", "parameters": {"a": 1}}'],
])  # fmt: skip
def test_streamed_tool_call_is_one_tool_calls_chunk(pieces):
    choices = _stream(pieces)
    *held, last = choices
    if held:  # the role first, no text of the call
        assert [c["delta"] for c in held] == [{"role": "assistant", "content": ""}]
    else:
        assert last["delta"]["role"] == "assistant"
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] is None
    (item,) = last["delta"]["tool_calls"]
    assert item["index"] == 0 and item["type"] == "function" and item["id"]
    assert item["function"]["name"] == "f"
    assert json.loads(item["function"]["arguments"]) == {"a": 1}


@pytest.mark.parametrize("pieces", [
    ["Hello", " there"],
    ["  ", "Hel", "lo"],
    ["<|py", "thon"],  # the tag's start, then not the tag
    ['{"weather": ', "1} and more"],  # held to the end, then not a call
    ['{"name": "f", "parameters": {}}', " and more"],
])  # fmt: skip
def test_streamed_plain_text_is_all_sent(pieces):
    choices = _stream(pieces, logprobs=True)
    assert "".join(c["delta"]["content"] for c in choices) == "".join(pieces)
    assert choices[0]["delta"]["role"] == "assistant"
    assert choices[-1]["finish_reason"] == "stop"
    assert not any("tool_calls" in c["delta"] for c in choices)
    tokens = [t["token"] for c in choices if c["logprobs"] for t in c["logprobs"]["content"]]
    assert tokens == [f"<{k}>" for k in range(len(pieces))]  # every token's logprobs, once


# ---- hermes -------------------------------------------------------------------------------

WEATHER = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}}'
)
HERMES_CALLS = [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a "}" b'})]),
    ('Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
     '<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call>',
     "Let me check.\n", [("f", {}), ("g", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": {"a": "<tool_call>"}}', None,
     [("f", {"a": "<tool_call>"})]),  # the last block left open
]  # fmt: skip
HERMES_TEXT = [
    "Hello <tool_", "<tool_call>not json</tool_call>", '<tool_call>{"name": 1}</tool_call>',
    '<tool_call>{"name": "\\q", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "a </tool_call> b",
]  # fmt: skip
BLOCKS = re.compile(r"<tool_call>.*?</tool_call>|<tool_call>.*", re.DOTALL)


@pytest.mark.parametrize("text,content,calls", HERMES_CALLS)
def test_hermes_calls_are_extracted(text, content, calls):
    assert get_tool_parser("hermes").extract(text) == (content, calls)


@pytest.mark.parametrize("text", HERMES_TEXT)
def test_hermes_other_answers_are_text(text):
    assert get_tool_parser("hermes").extract(text) == (text, [])


def _pieces(text: str, seed: int) -> list[str]:
    """`text` cut at random places (seed 0: one character each)."""
    if seed == 0:
        return list(text)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("text,content,calls", HERMES_CALLS)
def test_hermes_streams_content_then_each_call(text, content, calls, seed):
    """As vLLM streams them: text outside the blocks as content; per call a first delta with
    its index, id, type and name, then (name first) its arguments in pieces as written."""
    choices = _stream(_pieces(text, seed), logprobs=True, parser="hermes")
    assert "".join(c["delta"]["content"] or "" for c in choices) == BLOCKS.sub("", text)
    items = [t for c in choices for t in c["delta"].get("tool_calls", [])]
    got = []
    for k, (name, args) in enumerate(calls):
        mine = [t for t in items if t["index"] == k]
        head, rest = mine[0], mine[1:]
        assert head["id"] and head["type"] == "function" and head["function"]["name"] == name
        assert not any("id" in t or "name" in t["function"] for t in rest)
        arguments = "".join(t["function"]["arguments"] for t in mine)
        got.append((name, json.loads(arguments)))
        if seed == 0 and args and text.index(f'"{name}"') < text.index('"arguments"'):
            assert len(rest) > 1  # streamed as it came, not at the end
    assert got == calls and len({t["id"] for t in items if "id" in t}) == len(calls)
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert not any(c["finish_reason"] for c in choices[:-1])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("text", HERMES_TEXT + ["plain <tool text"])
def test_hermes_streamed_text_is_all_sent(text, seed):
    pieces = _pieces(text, seed)
    choices = _stream(pieces, logprobs=True, parser="hermes")
    assert "".join(c["delta"]["content"] for c in choices) == text
    assert choices[-1]["finish_reason"] == "stop"
    assert not any("tool_calls" in c["delta"] for c in choices)
    tokens = [t["token"] for c in choices if c["logprobs"] for t in c["logprobs"]["content"]]
    assert tokens == [f"<{k}>" for k in range(len(pieces))]  # every token's logprobs, once


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool_call_parser must be one of llama3_json, hermes"):
        get_tool_parser("mistral")


@pytest.fixture(scope="module")
def hermes_client(live_server):
    """What `serve --tool-call-parser hermes` builds (api_server.build_app), over the engine
    of the module's live server (conftest.py), on a port of its own."""
    import openai

    from llm_inference.entrypoints.openai.api_server import build_app

    app = build_app(live_server.llm, "tiny", tool_call_parser="hermes")
    with serving(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x",
                                             max_retries=0) as c:  # fmt: skip
        yield c


def test_hermes_tool_calls_through_the_server(hermes_client):
    """An answer with <tool_call> blocks (forced with guided_choice) comes back as its text
    before them and the calls, finish_reason "tool_calls"; streamed alike."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    answer = f"Let me check.\n<tool_call>\n{call}\n</tool_call>"
    chat = dict(model="tiny", max_tokens=100, tools=[tool], extra_body={"guided_choice": [answer]},
                messages=[{"role": "user", "content": "Weather in Paris?"}])  # fmt: skip
    r = hermes_client.chat.completions.create(**chat)
    (item,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Let me check.\n"
    assert item.function.name == "get_weather"
    assert json.loads(item.function.arguments) == {"city": "Paris"}
    chunks = [c for c in hermes_client.chat.completions.create(stream=True, **chat) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Let me check.\n"
    items = [t for d in deltas for t in d.tool_calls or []]
    assert items[0].id and items[0].function.name == "get_weather"
    assert json.loads("".join(t.function.arguments or "" for t in items)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_serve_option_picks_the_parser(monkeypatch):
    from llm_inference.entrypoints import cli

    seen = []
    fake = lambda **kw: seen.append(kw["tool_call_parser"])  # noqa: E731
    monkeypatch.setattr("llm_inference.entrypoints.openai.api_server.run_server", fake)
    assert cli.main(["serve"]) == 0 and cli.main(["serve", "--tool-call-parser", "hermes"]) == 0
    assert seen == ["llama3_json", "hermes"]
    with pytest.raises(SystemExit) as usage:
        cli.build_parser().parse_args(["serve", "--tool-call-parser", "pythonic"])
    assert usage.value.code == 2
