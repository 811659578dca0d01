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
