"""Tool calls in a chat answer, found as vLLM's tool parsers find them (`serve
--tool-call-parser`; `get_tool_parser(name)`):

- `llama3_json` (Llama 3.x): the whole answer is one JSON object, or several separated by `;`,
  each {"name": ..., "parameters" (or "arguments"): {...}}, optionally after `<|python_tag|>`.
  Anything else is plain text. Streamed, the answer is held back while it may still be calls
  (past leading whitespace: empty, starting with `{` or `<|python_tag|>`, or a start of
  `<|python_tag|>`: `may_be_tool_call`) and decided at the end.
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks (the last may be left open) after any text, which is the message's content. Streamed
  as vLLM streams them: the text before a block as content, then per call one delta with its
  index, id and name, then its arguments in pieces as the model writes them.

A parser's `extract(text)` gives a whole answer's (content, calls); `stream()` a `ToolStream`
for one streamed choice, whose `feed(delta, finished)` gives the content to send now and the
`delta.tool_calls` items.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod

PYTHON_TAG = "<|python_tag|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
ToolCall = tuple[str, dict]  # (function name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """llama3_json: [(function name, arguments)] if `text` is nothing but tool calls, else
    None."""
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


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def tool_call_items(calls: list[ToolCall]) -> list[dict]:
    """OpenAI's `message.tool_calls` for parsed calls."""
    return [{"id": _call_id(), "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in calls]  # fmt: skip


class ToolStream(ABC):
    """One streamed choice's text, turned into content and tool-call deltas as it comes."""

    called = False  # whether a tool call has been sent (the choice ends with "tool_calls")

    @abstractmethod
    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        """The content to send for the choice's next `delta` of text ("" while it is held
        back) and OpenAI's `delta.tool_calls` items; `finished`: the last delta."""


class ToolParser(ABC):
    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's (content, calls); (text, []) when it holds no call."""

    @abstractmethod
    def stream(self) -> ToolStream: ...


# ---- llama3_json ------------------------------------------------------------------------------


class Llama3JsonParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = parse_tool_calls(text)
        return (None, calls) if calls else (text, [])

    def stream(self) -> ToolStream:
        return _WholeAnswer()


class _WholeAnswer(ToolStream):
    """Held back while it may be calls, decided at the end; plain text from the moment it
    cannot be."""

    def __init__(self) -> None:
        self.text, self.plain = "", False

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        if self.plain:
            return delta, []
        self.text += delta
        if may_be_tool_call(self.text):
            if not finished:
                return "", []
            calls = parse_tool_calls(self.text)
            if calls:
                self.called = True
                return "", [{"index": k, **item} for k, item in enumerate(tool_call_items(calls))]
        self.plain = True
        return self.text, []


# ---- hermes ---------------------------------------------------------------------------------

_BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
# A call whose name comes first, up to the `{` that opens its arguments: streamable.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    args = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if not (isinstance(args, dict) and isinstance(obj.get("name"), str)):
        return None
    return obj["name"], args


class HermesParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            return text, []
        calls = [_hermes_call(m[1] if m[1] is not None else m[2]) for m in _BLOCKS.finditer(text)]
        if None in calls:  # as vLLM: one malformed block makes the whole answer text
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls

    def stream(self) -> ToolStream:
        return _HermesStream()


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (held back: the tag
    may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _ObjectEnd:
    """Where a JSON object fed in pieces ends: `feed` returns how many of the piece's
    characters belong to it."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped, self.in_string = ch == "\\", ch != '"'
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class _HermesStream(ToolStream):
    """Content up to each `<tool_call>` (a partial tag held back); inside a block, the call's
    head once its name is known, then its arguments object as it grows. A block whose name
    does not come first goes out whole at its end; a block that is no call, as content."""

    def __init__(self) -> None:
        self.pending = ""  # received, not yet placed
        self.body: str | None = None  # the open block's text so far (None: outside a block)
        self.index = -1  # the last call's index

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        self.pending += delta
        content, items = [], []
        while self.pending:
            if self.body is None:
                start = self.pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if finished else _partial_tag(self.pending, TOOL_CALL_START)
                    content.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                content.append(self.pending[:start])
                self.pending = self.pending[start + len(TOOL_CALL_START) :]
                self._open()
                continue
            end = self.pending.find(TOOL_CALL_END)
            if end < 0:
                keep = _partial_tag(self.pending, TOOL_CALL_END)
                self.body += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                items += self._progress()
                break
            self.body += self.pending[:end]
            self.pending = self.pending[end + len(TOOL_CALL_END) :]
            content.append(self._close(items, TOOL_CALL_END))
        if finished and self.body is not None:  # an open last block, as vLLM takes it
            self.body += self.pending
            self.pending = ""
            content.append(self._close(items, ""))
        return "".join(content), items

    def _open(self) -> None:
        self.body, self.head, self.sent, self.args = "", None, 0, _ObjectEnd()

    def _progress(self) -> list[dict]:
        """The open call's head, once its name is known, and its arguments written since."""
        items = []
        if self.head is None:
            head = _HEAD.match(self.body)
            try:
                name = json.loads(f'"{head[1]}"') if head else None
            except json.JSONDecodeError:  # a bad escape: the block is judged whole at its end
                name = None
            if name is None:
                return items
            self.head, self.index, self.called = head.end(), self.index + 1, True
            items.append({"index": self.index, "id": _call_id(), "type": "function",
                          "function": {"name": name, "arguments": ""}})  # fmt: skip
        if not self.args.done:
            new = self.body[self.head + self.sent :]
            piece = new[: self.args.feed(new)]
            if piece:
                self.sent += len(piece)
                items.append({"index": self.index, "function": {"arguments": piece}})
        return items

    def _close(self, items: list[dict], end_tag: str) -> str:
        """End the open block: its last deltas into `items`; returns the content it becomes
        (the block itself when it is no call and nothing of it was sent)."""
        body = self.body
        items += self._progress()
        self.body = None
        if self.head is not None:
            return ""
        call = _hermes_call(body)
        if call is None:
            return TOOL_CALL_START + body + end_tag
        self.index, self.called = self.index + 1, True
        items.append({"index": self.index, **tool_call_items([call])[0]})
        return ""


TOOL_PARSERS = {"llama3_json": Llama3JsonParser, "hermes": HermesParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, not {name!r}")
    return TOOL_PARSERS[name]()
