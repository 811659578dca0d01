"""Tool calls in a chat completion, as Llama 3 writes them (vLLM's `llama3_json` parser): the
whole answer is one JSON object, or several separated by `;`, each {"name": ..., "parameters"
(or "arguments"): {...}}, optionally after `<|python_tag|>`. Anything else is plain text.

Streaming: a text can still become a tool call while, past leading whitespace, it is empty,
starts with `{` or `<|python_tag|>`, or is the start of `<|python_tag|>`
(`may_be_tool_call`); the server holds such text back and decides at the end."""

from __future__ import annotations

import json
import uuid

PYTHON_TAG = "<|python_tag|>"


def parse_tool_calls(text: str) -> list[tuple[str, dict]] | None:
    """[(function name, arguments)] if `text` is nothing but tool calls, else None."""
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG) :].lstrip()
    if not s.startswith("{"):
        return None
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(s):
        try:
            obj, i = decoder.raw_decode(s, i)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        if not (isinstance(obj.get("name"), str) and isinstance(args, dict)):
            return None
        calls.append((obj["name"], args))
        while i < len(s) and (s[i].isspace() or s[i] == ";"):
            i += 1
    return calls or None


def may_be_tool_call(text: str) -> bool:
    """Whether `text` may be the start of an answer that `parse_tool_calls` accepts."""
    s = text.lstrip()
    return s.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(s)


def tool_call_items(calls: list[tuple[str, dict]]) -> list[dict]:
    """OpenAI's `message.tool_calls` for parsed calls."""
    return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in calls]  # fmt: skip
