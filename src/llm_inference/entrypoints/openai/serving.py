"""The endpoints' logic: OpenAI request -> prompts and SamplingParams -> AsyncLLM -> response.

A request is answered only after each of its prompts has produced its first output, so that
a prompt the engine refuses (too long, bad token ids) is a 400 even for a streamed request;
the refusal concerns that request alone. A client that goes away, before or during the
stream, aborts its requests.

Tokenizing and chat templating run in worker threads (`asyncio.to_thread`), not on the event
loop: a prompt of megabytes takes seconds to tokenize, and on the loop it would stall /health
and every stream for that long.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from llm_inference.beam_search import async_beam_search
from llm_inference.engine.async_llm import AsyncLLM, EngineDeadError
from llm_inference.engine.llm_engine import check_request_length
from llm_inference.entrypoints.chat_template import render_chat
from llm_inference.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from llm_inference.entrypoints.openai.responses import DeltaTracker, ResponseBuilder, new_id
from llm_inference.entrypoints.openai.streaming import (
    SSEResponse,
    merge,
    prepend,
    sse,
    until_disconnected,
)
from llm_inference.entrypoints.openai.tool_choice import forced_function, forced_tool_schema
from llm_inference.entrypoints.openai.tool_parser import get_tool_parser
from llm_inference.outputs import RequestOutput, RequestOutputKind, accumulate
from llm_inference.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)
from llm_inference.structured_output import check_spec

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)

# Arguments of apply_chat_template itself (transformers 5's, and those chat_prompt passes),
# which a request's chat_template_kwargs may not set: it adds template variables only.
# `chat_template` would replace the operator's template with the request's (vLLM refuses that
# unless the operator passes --trust-request-chat-template), and a template is code whose
# loops run on the server's threads.
TEMPLATE_ARGUMENTS = frozenset({
    "chat_template", "tokenize", "conversation", "conversations", "messages", "tools",
    "documents", "add_generation_prompt", "continue_final_message", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors",
})  # fmt: skip


class OpenAIServing:
    def __init__(
        self, llm: AsyncLLM, model_name: str, tool_call_parser: str = "llama3_json",
        chat_template: str | None = None,
    ):  # fmt: skip
        """`chat_template`: the operator's template (load_chat_template's), else the
        tokenizer's."""
        self.llm = llm
        self.model_name = model_name
        self.chat_template = chat_template
        self.tool_parser = get_tool_parser(tool_call_parser)  # for chat requests with tools
        self.tokenizer = llm.tokenizer
        # and whatever named arguments this tokenizer's apply_chat_template has besides
        named = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        self.template_arguments = TEMPLATE_ARGUMENTS | {
            p.name for p in named if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            message = f"The model `{name}` does not exist; this server serves `{self.model_name}`."
            raise APIError(404, message, param="model", code="model_not_found")

    # ---- prompts and parameters -----------------------------------------------------------

    def tokenize(self, text: str, param: str, **kwargs) -> list[int]:
        """`text`'s token ids. Text the tokenizer refuses is a 400 naming `param`: JSON's
        \\ud800 escapes carry lone surrogates, which the tokenizer raises TypeError for."""
        try:
            return self.tokenizer(text, **kwargs).input_ids
        except (TypeError, ValueError) as e:
            try:
                text.encode("utf-8")
                reason = str(e)
            except UnicodeEncodeError:
                reason = "it is not valid Unicode (it has a lone surrogate)"
            raise APIError(400, f"cannot tokenize the {param}: {reason}", param=param) from e

    def completion_prompts(self, prompt: Any) -> list[Prompt]:
        """Each prompt's (text, token ids); CPU work: run it in a thread."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return [(p, self.tokenize(p, "prompt")) if isinstance(p, str) else (None, list(p))
                for p in prompt]  # fmt: skip

    def prompt_texts(self, prompts: list[Prompt]) -> list[str]:
        """Each prompt's text, token ids decoded (for echo); CPU work: run it in a thread."""
        return [text if text is not None else self.tokenizer.decode(ids)
                for text, ids in prompts]  # fmt: skip

    def chat_prompt(self, req: ChatCompletionRequest) -> Prompt:
        """The chat template applied to the messages, as `LLM.chat` does; CPU work (the
        template is a program): run it in a thread."""
        kwargs = req.chat_template_kwargs or {}
        if reserved := sorted(self.template_arguments.intersection(kwargs)):
            raise APIError(400, f"chat_template_kwargs may not set {reserved}: they are the "
                           "server's arguments to apply_chat_template, not template variables "
                           "(a request's own chat_template is not accepted)",
                           param="chat_template_kwargs")  # fmt: skip
        messages = []
        for m in req.messages:
            msg = {"role": m.role, "content": m.text()}
            for key in ("tool_calls", "tool_call_id", "name"):  # tool turns, for the template
                if (m.model_extra or {}).get(key) is not None:
                    msg[key] = m.model_extra[key]
            messages.append(msg)
        tools = req.tools if req.uses_tools else None
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt=false",
                           param="continue_final_message")  # fmt: skip
        try:
            text = render_chat(
                self.tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tools=tools,
                chat_template_kwargs=kwargs, chat_template=self.chat_template,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        return text, self.tokenize(text, "messages", add_special_tokens=False)

    @staticmethod
    def sampling_params(
        req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None = None, structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:  # fmt: skip
        """SamplingParams from the request (`structured`: its `structured_outputs`); their
        ValueError (naming the field) becomes a 400."""
        if (field := req.unsupported()) is not None:
            raise APIError(400, f"{field} is not supported by this server", param=field)
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported with stream",
                           param="prompt_logprobs")  # fmt: skip
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options can only be given with stream=true",
                           param="stream_options")  # fmt: skip
        bias = None
        if req.logit_bias is not None:
            try:
                bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError as e:
                keys = sorted(req.logit_bias)[:5]
                msg = f"logit_bias keys must be token ids (integers as strings), got {keys}"
                raise APIError(400, msg, param="logit_bias") from e
        try:
            return SamplingParams(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
                logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                logit_bias=bias, allowed_token_ids=req.allowed_token_ids,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                prompt_logprobs=prompt_logprobs, bad_words=req.bad_words,
                structured_outputs=structured,
            )  # fmt: skip
        except ValueError as e:
            raise _field_error(e, req) from e

    # ---- endpoints ------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.echo and req.stream:
            raise APIError(400, "echo is not supported with stream", param="echo")
        prompts = await asyncio.to_thread(self.completion_prompts, req.prompt)
        # echo with logprobs: the prompt's tokens get theirs too
        prompt_lps = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_lps = max(req.logprobs, prompt_lps or 0)
        structured = await structured_outputs_in_thread(req)
        params = self.sampling_params(req, req.max_tokens, req.logprobs, prompt_lps, structured)
        builder = ResponseBuilder("completion", self.model_name, self.tokenizer, req.n)
        if req.echo:
            builder.echo = await asyncio.to_thread(self.prompt_texts, prompts)
            builder.echo_k = req.logprobs or 0
        builder.prompt_logprobs = req.prompt_logprobs is not None
        return await self._run(raw, prompts, params, builder, req)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:  # 0 is refused, as max_tokens 0 is
            max_tokens = req.max_completion_tokens
        structured = await structured_outputs_in_thread(req)
        params = self.sampling_params(req, max_tokens, logprobs, req.prompt_logprobs, structured)
        builder = ResponseBuilder("chat", self.model_name, self.tokenizer, req.n)
        builder.prompt_logprobs = req.prompt_logprobs is not None
        builder.forced = forced_function(req.tool_choice) if req.uses_tools else None
        builder.tool_parser = (
            self.tool_parser if req.uses_tools and builder.forced is None else None
        )
        prompt = await asyncio.to_thread(self.chat_prompt, req)
        return await self._run(raw, [prompt], params, builder, req)

    # ---- the shared flow ------------------------------------------------------------------

    async def _run(self, raw, prompts: list[Prompt], params, builder, req: _SamplingFields):
        if req.use_beam_search:
            streams = await self._beam_search(raw, prompts, params, builder, req)
        else:
            streams = await self._start(raw, prompts, params, builder.id, req)
        if req.stream:
            return SSEResponse(
                self._stream(streams, builder, req.include_usage, req.continuous_usage)
            )
        finals = await until_disconnected(raw, _collect(streams, params.n))
        return builder.response(finals)

    async def _start(self, raw, prompts: list[Prompt], params, request_id: str, req):
        """Start every prompt and wait for its first output; an engine refusal (or a grammar
        that failed to compile) is a 400, and the request's other prompts are aborted."""
        ids = [p[1] for p in prompts]
        delta = RequestOutputKind.DELTA
        gens = [self.llm.generate(t, params, f"{request_id}-{i}", output_kind=delta)
                for i, t in enumerate(ids)]  # fmt: skip
        firsts = await until_disconnected(
            raw, asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
        )
        errors = [(i, e) for i, e in enumerate(firsts) if isinstance(e, BaseException)]
        if errors:
            for g in gens:
                await g.aclose()
            index, error = errors[0]
            raise _api_error(error, len(prompts), index, req)
        return [prepend(first, g) for first, g in zip(firsts, gens)]

    async def _beam_search(self, raw, prompts: list[Prompt], params, builder, req):
        """vLLM's `use_beam_search`: the n best beams of each prompt (beam_search.py), all at
        once when the search ends, as one-output streams for `_run`. Takes the plain request
        only: logprobs, echo, stop strings, tools and the rest are 400s."""
        asked = {"logprobs": params.logprobs is not None, "echo": builder.echo is not None,
                 "prompt_logprobs": params.prompt_logprobs is not None,
                 "stop": bool(params.stop_strings), "tools": builder.tool_parser is not None,
                 "structured_outputs": params.structured_outputs is not None}  # fmt: skip
        for name, on in asked.items():
            if on:
                raise APIError(400, f"use_beam_search does not take {name}", param=name)
        max_len = self.llm.max_model_len
        try:
            search = BeamSearchParams(
                beam_width=req.n, max_tokens=params.max_tokens or max_len,
                ignore_eos=req.ignore_eos, temperature=req.temperature,
                length_penalty=req.length_penalty,
            )  # fmt: skip
        except ValueError as e:
            raise _field_error(e, req) from e
        for i, (_, ids) in enumerate(prompts):  # the one length check (llm_engine.py) with
            try:  # max_tokens: the rounds check less
                check_request_length(max_len, len(ids), params.max_tokens)
            except ValueError as e:
                raise _api_error(e, len(prompts), i) from e
        work = asyncio.gather(*(async_beam_search(self.llm, ids, search, f"{builder.id}-{i}")
                                for i, (_, ids) in enumerate(prompts)))  # fmt: skip
        try:
            finals = await until_disconnected(raw, work)
        except (ValueError, TypeError) as e:
            raise _api_error(e, len(prompts)) from e
        return [_once(out) for out in finals]

    async def _stream(
        self, streams, builder: ResponseBuilder, include_usage: bool, continuous_usage: bool
    ):
        """The chunks, then with `include_usage` a usage chunk; with `continuous_usage` every
        chunk carries the usage so far too (vLLM's continuous_usage_stats)."""
        tracker = DeltaTracker(builder)
        try:
            async for i, out in merge(streams):
                for chunk in tracker.chunks(i, out):
                    if continuous_usage:
                        chunk["usage"] = tracker.usage()
                    yield sse(chunk)
            if include_usage:
                yield sse(builder.usage_chunk(tracker.usage()))
        except Exception as e:  # noqa: BLE001 - the status is sent already: report in-band
            yield sse(_api_error(e, len(streams)).body())
        yield sse("[DONE]")


async def structured_outputs_in_thread(req: _SamplingFields) -> StructuredOutputsParams | None:
    """`structured_outputs(req)` in a worker thread when the request asks for any: xgrammar
    parses the spec (a large schema takes a while; the first loads xgrammar), which on the
    event loop would stall every stream."""
    fields = (req.structured_outputs, req.guided_json, req.guided_regex, req.guided_grammar,
              req.guided_choice, req.response_format)  # fmt: skip
    forced = getattr(req, "tool_choice", None) not in (None, "auto", "none")
    if not forced and all(f is None for f in fields):
        return None
    return await asyncio.to_thread(structured_outputs, req)


def structured_outputs(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's structured outputs, from the one field that asks for them:
    `structured_outputs` (vLLM's), a `guided_*` field (its older names), `response_format`
    (OpenAI's: json_object, or json_schema, whose `strict` is accepted: answers always follow
    the schema strictly; vLLM's structural_tag) or chat's `tool_choice` "required" or named
    (tool_choice.py). A spec that xgrammar cannot take (structured_output.check_spec), or two
    fields at once, is a 400 naming the field."""
    given = structured_fields(req)
    if len(given) > 1:
        names = " and ".join(field for field, _, _ in given)
        raise APIError(400, f"{names} both ask for structured outputs: give one",
                       param=given[1][0])  # fmt: skip
    if not given:
        return None
    field, name, kwargs = given[0]
    try:
        so = StructuredOutputsParams(**kwargs)
        check_spec(so)
    except (TypeError, ValueError) as e:
        raise APIError(400, _named(str(e), name), param=field) from e
    return so


def structured_fields(req: _SamplingFields) -> list[tuple[str, str, dict]]:
    """(field, its name in errors, StructuredOutputsParams kwargs) of each of the request's
    fields that ask for structured outputs (`structured_outputs`)."""
    given: list[tuple[str, str, dict]] = []
    if req.structured_outputs:
        so = dict(req.structured_outputs)
        unknown = sorted(set(so) - {*StructuredOutputsParams.KINDS, "disable_any_whitespace"})
        if unknown:
            raise APIError(400, f"structured_outputs: unknown keys {unknown}",
                           param="structured_outputs")  # fmt: skip
        given.append(("structured_outputs", "", so))
    for kind in ("json", "regex", "grammar", "choice"):
        if (value := getattr(req, f"guided_{kind}")) is not None:
            given.append((f"guided_{kind}", f"guided_{kind}", {kind: value}))
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        given.append(("response_format", *_response_format(fmt)))
    forced = forced_tool_choice(req)
    if forced is not None:  # arguments on one line (tool_choice.py)
        given.append(("tool_choice", "tools", {"json": forced, "disable_any_whitespace": True}))
    return given


def _named(message: str, name: str) -> str:
    """An error about `structured_outputs.<kind>` with the spec named as the request names it
    (`name`; "": the request's own structured_outputs field)."""
    return re.sub(r"^structured_outputs(\.\w+)?", name, message) if name else message


def _response_format(fmt: dict) -> tuple[str, dict]:
    """(its name in errors, StructuredOutputsParams kwargs) of a response_format."""
    if fmt.get("type") == "json_object":
        return "response_format", {"json_object": True}
    schema = fmt.get("json_schema")
    if fmt.get("type") == "json_schema":
        if not (isinstance(schema, dict) and "schema" in schema):
            raise APIError(400, "response_format json_schema needs json_schema: {name, schema, "
                           "strict}", param="response_format")  # fmt: skip
        return "response_format.json_schema.schema", {"json": schema["schema"]}
    if fmt.get("type") == "structural_tag":  # the whole object is the tag, as vLLM takes it
        return "response_format", {"structural_tag": fmt}
    raise APIError(400, f"response_format type {fmt.get('type')!r} is not supported (text, "
                   "json_object, json_schema and structural_tag are)",
                   param="response_format")  # fmt: skip


def forced_tool_choice(req: _SamplingFields) -> dict | None:
    """The JSON schema a chat request's tool_choice "required" or named function puts on the
    answer (tool_choice.py); None for none and auto."""
    if not isinstance(req, ChatCompletionRequest) or req.tool_choice in (None, "auto", "none"):
        return None
    try:
        forced = forced_function(req.tool_choice)
        return forced_tool_schema(req.tools, forced, req.parallel_tool_calls)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from e


async def _once(out: RequestOutput) -> AsyncIterator[RequestOutput]:
    """A stream of one finished output."""
    yield out


async def _collect(streams: list[AsyncIterator[RequestOutput]], n: int) -> list[RequestOutput]:
    """Each prompt's cumulative output (of `n` completions), from its DELTA outputs."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        finals[i] = accumulate(finals[i], out, n)
    return finals


def _field_error(e: ValueError, req: _SamplingFields) -> APIError:
    """A 400 for a `SamplingParams` or `BeamSearchParams` error, whose message starts with the
    parameter, named as the request's field (chat's top_logprobs, not logprobs)."""
    message = str(e)
    param = message.split()[0].rstrip(":")
    field = req.field_name(param)
    return APIError(400, field + message[len(param) :], param=field)


# Fields of both requests that the engine checks (against the vocabulary): its error about one
# starts with the field's name, and is the field's, not the prompt's.
ENGINE_CHECKED_FIELDS = ("logit_bias", "allowed_token_ids")


def _api_error(
    e: BaseException, num_prompts: int, index: int | None = None, req: _SamplingFields | None = None
) -> APIError:
    """The APIError of an engine's error about the request (of `num_prompts` prompts; `index`:
    the prompt it is about, where known, counted from 0 as LLM.generate's errors count; `req`:
    the request, whose field an error about its structured outputs names)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):
        message, param = str(e), "prompt"
        if (field := message.split(" ", 1)[0]) in ENGINE_CHECKED_FIELDS:
            return APIError(400, message, param=field)
        about_spec = req is not None and message.startswith("structured_outputs")
        if about_spec and (given := structured_fields(req)):  # a grammar that failed to compile
            param, name, _ = given[0]
            message = _named(message, name)
        which = "a prompt" if index is None else f"prompt {index}"
        return APIError(400, message if num_prompts == 1 else f"{which}: {message}", param=param)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error", code="engine_dead")
    return APIError(500, f"internal error: {e!r}", type="server_error")


__all__ = ["OpenAIServing", "new_id"]
