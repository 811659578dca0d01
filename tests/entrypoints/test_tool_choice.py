"""tool_choice "required" and named (entrypoints/openai/tool_choice.py): the JSON schema an
answer must follow, and the calls read back from it, whole or as it streams in pieces."""

from __future__ import annotations

import json
import re

import pytest

from llm_inference.entrypoints.openai.tool_choice import (
    EMPTY_PARAMETERS,
    ForcedToolCalls,
    forced_function,
    forced_tool_calls,
    forced_tool_schema,
)

ZONE = {"enum": ["UTC", "CET"]}
TOOLS = [
    {"type": "function", "function": {"name": "time", "parameters": {
        "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
        "$defs": {"zone": ZONE}}}},
    {"type": "function", "function": {"name": "ping"}},
]  # fmt: skip


def test_schemas_of_named_and_required():
    assert forced_tool_schema(TOOLS, "time") == TOOLS[0]["function"]["parameters"]
    assert forced_tool_schema(TOOLS, "ping") == EMPTY_PARAMETERS
    schema = forced_tool_schema(TOOLS, "required")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"zone": ZONE}  # at the root, where "#/$defs/zone" points
    time, ping = schema["items"]["anyOf"]
    assert time["properties"]["name"] == {"type": "string", "enum": ["time"]}
    assert "$defs" not in time["properties"]["parameters"]
    assert ping["properties"]["parameters"] == EMPTY_PARAMETERS
    assert "$defs" in TOOLS[0]["function"]["parameters"]  # the request's tools untouched
    assert forced_tool_schema(TOOLS, "required", parallel=False)["maxItems"] == 1


@pytest.mark.parametrize(
    "tools, forced, message",
    [(None, "required", "tool_choice 'required' needs tools"),
     (TOOLS, "nope", "tool_choice names 'nope', which is not one of the tools"),
     ([{"function": {}}], "required", "tools[0] must be a function: {'type': 'function'"),
     (TOOLS + [{"function": {"name": "x", "parameters": {"$defs": {"zone": {}}}}}], "required",
      "tools define $defs/zone twice, differently")],
)  # fmt: skip
def test_schema_errors(tools, forced, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        forced_tool_schema(tools, forced)


def test_forced_function():
    assert forced_function("auto") is None and forced_function(None) is None
    assert forced_function("required") == "required"
    assert forced_function({"type": "function", "function": {"name": "f"}}) == "f"
    for bad in ("always", {"type": "function"}, {"type": "other", "function": {"name": "f"}}):
        with pytest.raises(ValueError, match="tool_choice must be 'auto', 'none', 'required'"):
            forced_function(bad)


def test_calls_read_whole_and_in_pieces():
    """A "required" answer fed in pieces of every size gives its calls, each once complete, as
    read whole; a named answer streams its arguments, the first piece with the id and name."""
    answer = '[{"name": "time", "parameters": {"zone": "UTC"}}, {"name": "ping", "parameters": {}}]'
    whole = forced_tool_calls("required", answer)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == [
        ("time", {"zone": "UTC"}), ("ping", {})]  # fmt: skip
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in whole)
    for size in (1, 3, 17, len(answer)):
        reader, got = ForcedToolCalls("required"), []
        for i in range(0, len(answer), size):
            items = reader.add(answer[i : i + size])
            got += items
            if i + size < answer.index("}}") + 2:  # the first call is not complete yet
                assert not items
        assert [c["index"] for c in got] == [0, 1]
        assert [c["function"] for c in got] == [c["function"] for c in whole]
    cut = forced_tool_calls("required", answer[:60])  # cut by max_tokens: the complete calls
    assert [c["function"]["name"] for c in cut] == ["time"]
    reader = ForcedToolCalls("time")
    pieces = ['{"zone"', ': "CET"', "}"]
    items = [reader.add(p) for p in pieces]
    assert items[0][0]["function"] == {"name": "time", "arguments": '{"zone"'} and items[0][0]["id"]
    assert all(list(i[0]) == ["index", "function"] for i in items[1:])
    assert "".join(i[0]["function"]["arguments"] for i in items) == '{"zone": "CET"}'
    (call,) = forced_tool_calls("time", '{"zone": "CET"}')
    assert call["function"] == {"name": "time", "arguments": '{"zone": "CET"}'}
