"""OpenAI response bodies built from RequestOutputs: completions, chat completions, their
stream chunks, usage and logprobs. Streams are built from DELTA outputs (`DeltaTracker`), the
other responses from cumulative ones.

Choice `index` is `prompt_index * n + completion_index`, as OpenAI numbers the choices of a
request with several prompts. Logprobs of -inf are sent as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from typing import Any

from llm_inference.entrypoints.openai.tool_choice import ForcedToolCalls, forced_tool_calls
from llm_inference.entrypoints.openai.tool_parser import ToolParser, ToolStream, tool_call_items
from llm_inference.outputs import CompletionOutput, Logprobs, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    """The usage of `prompt` tokens (the tokenized prompts) and `completion` (generated) ones."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _lp(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def _offsets(tokens: list[str], start: int) -> list[int]:
    """Each token's text offset, the first at `start`."""
    return list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=start))[: len(tokens)]


class ResponseBuilder:
    """Builds one request's bodies; `kind` is "completion" or "chat"."""

    def __init__(self, kind: str, model: str, tokenizer, n: int) -> None:
        self.kind, self.model, self.tokenizer, self.n = kind, model, tokenizer, n
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.echo: list[str] | None = None  # completions with echo: each prompt's text
        self.echo_k = 0  # with echo and logprobs=k: the prompt tokens' top-k
        self.prompt_logprobs = False  # vLLM's prompt_logprobs field in the response
        # chat with tools: the parser that finds tool calls in an answer (tool_parser.py)
        self.tool_parser: ToolParser | None = None
        # chat with tool_choice "required" or a function's name: every answer is tool calls
        # (tool_choice.py), finish_reason "tool_calls" once complete
        self.forced: str | None = None

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model}  # fmt: skip

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    # ---- logprobs -------------------------------------------------------------------------

    def completion_top(self, lp: Logprobs, k: int | None = None) -> dict[str, float]:
        """A completions `top_logprobs` entry: the token itself first, then the `k` (all)
        most likely, as OpenAI's completions ("up to logprobs + 1 elements") and vLLM give it:
        with logprobs=0 the token alone, never an empty entry. Keys are texts: where two
        tokens read the same (pieces of one character), the first keeps its entry."""
        out = {self.token_text(lp.token_id): _lp(lp.logprob)}
        for t, v in list(lp.top.items())[:k]:
            out.setdefault(self.token_text(t), _lp(v))
        return out

    def completion_logprobs(self, lps: list[Logprobs], offset: int) -> dict[str, Any]:
        """OpenAI's completions format; `offset` is the text offset of the first token."""
        tokens = [self.token_text(lp.token_id) for lp in lps]
        return {
            "tokens": tokens,
            "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": [self.completion_top(lp) for lp in lps],
            "text_offset": _offsets(tokens, offset),
        }

    def chat_logprobs(self, lps: list[Logprobs]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            tok = self.token_text(token_id)
            return {"token": tok, "logprob": _lp(logprob), "bytes": list(tok.encode())}

        content = []
        for lp in lps:
            item = entry(lp.token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top.items()]
            content.append(item)
        return {"content": content}

    def echo_logprobs(self, out: RequestOutput, lps: list[Logprobs]) -> dict[str, Any]:
        """Completions' logprobs with echo: the prompt's tokens first (the first has none),
        then the completion's, offsets running on through both."""
        prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        tokens = [self.token_text(t) for t in out.prompt_token_ids]
        body = self.completion_logprobs(lps, sum(map(len, tokens)))
        top = [None if lp is None else self.completion_top(lp, self.echo_k) for lp in prompt_lps]
        return {
            "tokens": tokens + body["tokens"],
            "token_logprobs": [None if lp is None else _lp(lp.logprob) for lp in prompt_lps]
            + body["token_logprobs"],
            "top_logprobs": top + body["top_logprobs"],
            "text_offset": _offsets(tokens, 0) + body["text_offset"],
        }

    def vllm_prompt_logprobs(self, lps: list[Logprobs | None] | None) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
        decoded_token}} for the token itself and the most likely ones there."""

        def entry(lp: Logprobs) -> dict[str, dict]:
            top = {**lp.top, lp.token_id: lp.logprob}  # the token's own entry included
            return {str(t): {"logprob": _lp(v), "decoded_token": self.token_text(t)}
                    for t, v in top.items()}  # fmt: skip

        return None if lps is None else [None if lp is None else entry(lp) for lp in lps]

    def logprobs(self, lps: list[Logprobs] | None, offset: int = 0) -> dict[str, Any] | None:
        if lps is None:
            return None
        if self.kind == "completion":
            return self.completion_logprobs(lps, offset)
        return self.chat_logprobs(lps)

    # ---- whole responses ------------------------------------------------------------------

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                choice: dict[str, Any] = {"index": i * self.n + c.index}
                content, calls = c.text, []
                if self.kind == "completion":
                    choice["text"] = c.text if self.echo is None else self.echo[i] + c.text
                else:
                    choice["message"] = {"role": "assistant", "content": c.text}
                    if self.tool_parser is not None:
                        content, calls = self.tool_parser.extract(c.text)
                if self.echo is not None and c.logprobs is not None:
                    choice["logprobs"] = self.echo_logprobs(out, c.logprobs)
                else:
                    choice["logprobs"] = self.logprobs(c.logprobs)
                choice["finish_reason"] = c.finish_reason
                choice["stop_reason"] = c.stop_reason
                if calls:
                    choice["message"] = {"role": "assistant", "content": content,
                                         "tool_calls": tool_call_items(calls)}  # fmt: skip
                    choice["finish_reason"] = "tool_calls"
                if self.forced is not None and (items := forced_tool_calls(self.forced, c.text)):
                    choice["message"] = {"role": "assistant", "content": None,
                                         "tool_calls": items}  # fmt: skip
                    choice["finish_reason"] = _forced_finish(c.finish_reason)
                if self.prompt_logprobs and self.kind == "completion":
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        name = "text_completion" if self.kind == "completion" else "chat.completion"
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        body = {**self._head(name), "choices": choices, "usage": usage(prompt, completion)}
        if self.prompt_logprobs and self.kind == "chat":  # one prompt: at the top, as vLLM
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(outputs[0].prompt_logprobs)
        return body

    # ---- stream chunks --------------------------------------------------------------------

    def chunk(self, index: int, text: str, lps: dict | None, finish_reason: str | None,
              first: bool, tool_calls: list[dict] = ()) -> dict[str, Any]:  # fmt: skip
        """One choice's delta; a chat choice's first chunk also carries the role, and its
        `tool_calls` items (tool_parser.ToolStream's) come with content None when no text."""
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": text}
            name = "text_completion"
        else:
            delta = {"role": "assistant"} if first else {}
            delta["content"] = None if tool_calls and not text else text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta}
            name = "chat.completion.chunk"
        choice["logprobs"] = lps
        choice["finish_reason"] = finish_reason
        return {**self._head(name), "choices": [choice]}

    def forced_chunk(self, index: int, items: list[dict], lps: dict | None,
                     finish_reason: str | None, first: bool) -> dict[str, Any]:  # fmt: skip
        """A chat choice's delta of forced tool calls (`items`: tool_choice.py's)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if items:
            delta |= {"content": None, "tool_calls": items}
        choice = {"index": index, "delta": delta, "logprobs": lps,
                  "finish_reason": _forced_finish(finish_reason)}  # fmt: skip
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        name = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._head(name), "choices": [], "usage": counts}


def _forced_finish(reason: str | None) -> str | None:
    """A forced tool call's finish_reason: "tool_calls" when its answer ended as it should."""
    return "tool_calls" if reason == "stop" else reason


class DeltaTracker:
    """Stream chunks from DELTA outputs (`AsyncLLM.generate(output_kind=DELTA)`): each
    delta's new text and logprobs become one chunk per choice; the concatenated chunks equal
    the final text. Counts every prompt's and completion's tokens for the usage chunk.

    Chat with tools: each choice's text goes through its `ToolStream` (tool_parser.py),
    which says what to send as content (text that may still be a call is held back, after a
    first chunk with the role alone) and the `tool_calls` deltas; a choice that sent calls
    ends with finish_reason "tool_calls", as the non-streamed response. A token's logprobs go
    out once, with the first chunk of content after it (those of tokens that became calls,
    never). Chat with a forced tool choice: each delta's text goes out as the tool-call deltas
    it completes (tool_choice.ForcedToolCalls); text that completes none waits, with its
    logprobs, for the delta that does."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.chat = builder.kind == "chat"
        self.offsets: dict[tuple[int, int], int] = {}  # choices sent so far: text offset
        self.prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens
        self.completion_tokens = 0
        # chat with tools: each choice's tool stream and the logprobs it holds back
        self.streams: dict[tuple[int, int], ToolStream] = {}
        self.held: dict[tuple[int, int], list[Logprobs]] = {}
        self.forced: dict[tuple[int, int], ForcedToolCalls] = {}  # a forced tool choice's

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict[str, Any]]:
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        result = []
        for c in out.outputs:
            self.completion_tokens += len(c.token_ids)
            chunk = self._chunk(prompt_index, c)
            if chunk is not None:
                result.append(chunk)
        return result

    def usage(self) -> dict[str, int]:
        return usage(sum(self.prompt_tokens.values()), self.completion_tokens)

    def _chunk(self, i: int, c: CompletionOutput) -> dict[str, Any] | None:
        key = (i, c.index)
        index = i * self.builder.n + c.index
        offset = self.offsets.get(key)
        first = offset is None
        if self.builder.forced is not None:
            return self._forced_chunk(key, index, c, first)
        text, new_lps, calls, finish = c.text, c.logprobs, [], c.finish_reason
        parser = self.builder.tool_parser
        if parser is not None:
            stream = self.streams.get(key)
            if stream is None:
                stream = self.streams[key] = parser.stream()
            text, calls = stream.feed(c.text, finish is not None)
            if new_lps is not None:
                new_lps = self.held.pop(key, []) + new_lps
                if not text:
                    self.held[key], new_lps = new_lps, None
            if finish is not None and stream.called:
                finish = "tool_calls"
        if not ((first and self.chat) or text or calls or new_lps or finish is not None):
            return None
        offset = offset or 0
        lps = self.builder.logprobs(new_lps, offset)
        if new_lps:
            offset += sum(len(self.builder.token_text(lp.token_id)) for lp in new_lps)
        self.offsets[key] = offset
        return self.builder.chunk(index, text, lps, finish, first, calls)

    def _forced_chunk(self, key, index: int, c: CompletionOutput, first: bool):
        reader = self.forced.setdefault(key, ForcedToolCalls(self.builder.forced))
        new_lps = self.held.pop(key, []) + (c.logprobs or [])
        items = reader.add(c.text)
        self.offsets[key] = 0
        if not items and c.finish_reason is None:  # the role now, the calls when complete
            self.held[key] = new_lps
            return self.builder.forced_chunk(index, [], None, None, True) if first else None
        lps = None if c.logprobs is None else self.builder.logprobs(new_lps, 0)
        return self.builder.forced_chunk(index, items, lps, c.finish_reason, first)
