"""Chat `tool_choice` "required" and a named function: the answer is constrained to tool calls
by a JSON schema (structured outputs), then read back as `tool_calls` (vLLM's way: its
`_get_json_schema_from_tool`):

- a named function: the answer is the call's arguments, an object of the function's
  `parameters` schema;
- "required": the answer is a JSON array of one call or more (one with OpenAI's
  `parallel_tool_calls` false), each `{"name": ..., "parameters": {...}}` of one of the tools
  (the tools' `$defs` gathered at the schema's root, where their `#/$defs/...` references
  point).

The JSON is one line (no whitespace but after `,` and `:`), unlike vLLM's, which lets the model
put any whitespace between tokens: a tool call's arguments gain nothing from layout, and a
model unsure of its next token can otherwise drift into whitespace until max_tokens.

`ForcedToolCalls` reads such an answer as it grows, for the stream: a named call streams its
arguments as they come (the first delta with the call's id and name, as vLLM's); "required"
calls go out each once it is complete. `forced_tool_calls` reads a whole answer. A call's id
is new per call (`chatcmpl-tool-...`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters`


def _functions(tools: list[dict] | None) -> dict[str, dict]:
    """The tools' functions by name; a 400-worthy ValueError for a malformed tool."""
    out = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise ValueError(f"tools[{i}] must be a function: " + "{'type': 'function', "
                             "'function': {'name': ..., 'parameters': {...}}}")  # fmt: skip
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[fn["name"]] = fn
    return out


def forced_function(tool_choice: Any) -> str | None:
    """The function a named `tool_choice` forces, "required" for any, else None (auto, none)."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return "required"
    named = isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function"
    fn = tool_choice.get("function") if named else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise ValueError(
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
            f"'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    return fn["name"]


def forced_tool_schema(tools: list[dict] | None, forced: str, parallel: bool = True) -> dict:
    """The JSON schema an answer to `forced` (a function's name, or "required": several calls
    if `parallel`) must follow; ValueError (a 400) when the tools do not allow it."""
    functions = _functions(tools)
    if not functions:
        raise ValueError(f"tool_choice {forced!r} needs tools")
    if forced != "required":
        if forced not in functions:
            raise ValueError(f"tool_choice names {forced!r}, which is not one of the tools "
                             f"{sorted(functions)}")  # fmt: skip
        return functions[forced].get("parameters") or EMPTY_PARAMETERS
    defs: dict[str, Any] = {}
    calls = []
    for name, fn in functions.items():
        params = dict(fn.get("parameters") or EMPTY_PARAMETERS)
        for key, schema in params.pop("$defs", {}).items():
            if defs.setdefault(key, schema) != schema:
                raise ValueError(f"tools define $defs/{key} twice, differently")
        calls.append({"properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})  # fmt: skip
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {**schema, "$defs": defs} if defs else schema


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


class ForcedToolCalls:
    """One choice's answer to a forced tool choice, read as it grows: `add(text)` returns the
    `tool_calls` delta items the new text completes (module docstring)."""

    def __init__(self, forced: str) -> None:
        self.forced = forced
        self.text = ""
        self.pos = 0  # "required": where the next call starts
        self.sent = 0  # calls whose first delta went out

    def add(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if self.forced != "required":
            if not text and self.sent:
                return []
            first = not self.sent
            self.sent = 1
            fn = {"name": self.forced, "arguments": text} if first else {"arguments": text}
            head = {"id": tool_call_id(), "type": "function"} if first else {}
            return [{"index": 0, **head, "function": fn}]
        items = []
        for name, args in self._complete_calls():
            items.append({"index": self.sent, "id": tool_call_id(), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}})  # fmt: skip
            self.sent += 1
        return items

    def _complete_calls(self) -> list[tuple[str, dict]]:
        """The calls of a "required" answer completed since the last call (the answer is a
        JSON array, its text a prefix of one: the grammar allows no other)."""
        decoder, calls, s = json.JSONDecoder(), [], self.text
        while True:
            i = self.pos
            while i < len(s) and (s[i].isspace() or s[i] in "[,"):
                i += 1
            try:
                obj, end = decoder.raw_decode(s, i)
            except json.JSONDecodeError:
                return calls
            calls.append((obj["name"], obj["parameters"]))
            self.pos = end


def forced_tool_calls(forced: str, text: str) -> list[dict[str, Any]]:
    """`message.tool_calls` of a whole answer to `forced` (for a "required" answer cut short,
    its complete calls)."""
    items = ForcedToolCalls(forced).add(text)
    for item in items:
        del item["index"]
    return items
