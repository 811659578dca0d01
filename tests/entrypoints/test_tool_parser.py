"""Llama 3's tool calls in an answer (tool_parser.py, as vLLM's llama3_json parser)."""

from __future__ import annotations

import json

import pytest

from llm_inference.entrypoints.openai.tool_parser import parse_tool_calls, tool_call_items

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


def _stream(pieces: list[str], logprobs: bool = False) -> list[dict]:
    """The chat chunks a tools request streams for one answer arriving in `pieces`."""
    from llm_inference.entrypoints.openai.responses import DeltaTracker, ResponseBuilder
    from llm_inference.outputs import CompletionOutput, Logprobs, RequestOutput

    class Tok:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    builder = ResponseBuilder("chat", "m", Tok(), n=1)
    builder.tools = True
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
