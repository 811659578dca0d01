"""Request bodies of the OpenAI-compatible API (pydantic), and the OpenAI error format.

Field names and defaults follow OpenAI's API, plus the extra fields vLLM accepts (those of
`_SamplingFields` marked vLLM's: sampling, structured outputs, beam search).
Fields of UNSUPPORTED are refused with a 400 naming them; other unknown fields are ignored; an
explicit null means the field's default. `n` is bounded here (OpenAI's 1..128); other values are
range-checked by `SamplingParams` (and `BeamSearchParams`), whose errors name the field. Chat
content is text only (`content_text`: other parts are a 400 naming them); chat `tools` are
parsed from the answer as Llama 3 writes calls (tool_parser.py), or, with `tool_choice`
"required" or a named function, the answer is constrained to calls (tool_choice.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llm_inference.entrypoints.chat_template import content_text

# OpenAI's limit on `n`. Each of the n completions is a sequence the engine fans out on its
# one front-end thread, so an unbounded n would stall every request (and grow memory).
MAX_N = 128
# Bounds on a request's lists: each entry costs Python work on the server's one front-end
# thread (tokenizing), in every step (a mask, a bias) or per token (a stop-string search), so
# an unbounded list stalls every stream. Above a bound: a 400 naming the field.
LIST_LIMITS = {"stop": 16, "stop_token_ids": 1024, "bad_words": 1024, "logit_bias": 1024,
               "allowed_token_ids": 16384, "guided_choice": 1024}  # fmt: skip
MAX_PROMPTS = 1024  # prompts in one completions request


class APIError(Exception):
    """An error to answer in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:  # fmt: skip
        # a lone surrogate (JSON's \ud800 escapes carry them) quoted from the request would
        # make the body unencodable as UTF-8: it is kept as its escape
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)  # fmt: skip

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


class _NullIsDefault(BaseModel):
    """A request model where an explicit null means the field's default, as OpenAI and vLLM
    read it: clients send `"temperature": null` for a value they leave unset. Required fields
    and fields whose default is None are left to validation as they are."""

    @model_validator(mode="before")
    @classmethod
    def _drop_defaulted_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = {k for k, f in cls.model_fields.items()
                     if not f.is_required() and f.default is not None}  # fmt: skip
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


class StreamOptions(_NullIsDefault):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far too
    continuous_usage_stats: bool = False


# Fields of OpenAI's or vLLM's API that this server does not implement: a request that sets
# one (to anything but an off value) gets a 400 naming it, not an answer that ignored it. A
# request's own `chat_template` too: the operator's (serve --chat-template) or the tokenizer's
# renders every chat, as vLLM does unless told to trust the requests' templates.
UNSUPPORTED = (
    "functions", "function_call", "best_of", "suffix", "logits_processors", "chat_template",
)  # fmt: skip


def _is_off(field: str, value: Any) -> bool:
    """Whether an UNSUPPORTED field's value asks for nothing (what clients send by default)."""
    if value is None or value is False or value in ("", [], {}):
        return True
    return field == "best_of" and type(value) is int and value == 1


class _SamplingFields(_NullIsDefault):
    """The sampling fields both endpoints share. Other fields are kept (`model_extra`) only to
    refuse the UNSUPPORTED ones; the rest are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None  # None: what fits in the context
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extra sampling fields
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    # Structured outputs (serving.structured_outputs): OpenAI's response_format ({"type":
    # "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}),
    # vLLM's structured_outputs ({"json" | "regex" | "choice" | "grammar" | "json_object": ...})
    # and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's beam search: the n best beams (beam_search.py), scored with length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be an integer >= 1 and <= {MAX_N}, got {n}")
        return n

    @field_validator(*LIST_LIMITS)
    @classmethod
    def _bounded(cls, value: Any, info) -> Any:
        limit = LIST_LIMITS[info.field_name]
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ValueError(f"at most {limit} entries, got {len(value)}")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _bounded_choice(cls, value: dict | None) -> dict | None:
        choice = (value or {}).get("choice")
        limit = LIST_LIMITS["guided_choice"]
        if isinstance(choice, list) and len(choice) > limit:
            raise ValueError(f"choice: at most {limit} entries, got {len(choice)}")
        return value

    def field_name(self, param: str) -> str:
        """The request field a `SamplingParams` or `BeamSearchParams` parameter came from, to
        name it in that parameter's error."""
        return "n" if param == "beam_width" else param

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def unsupported(self) -> str | None:
        """The first UNSUPPORTED field this request sets, or None."""
        extra = self.model_extra or {}
        return next((k for k in UNSUPPORTED if k in extra and not _is_off(k, extra[k])), None)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _bounded_prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts, got {len(prompt)}")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (`content_text`); content that is not text is a 400."""
        try:
            return content_text(self.content)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from e


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last (assistant) message
    tools: list[dict[str, Any]] | None = None  # given to the chat template
    # "auto" or "none" (tool_parser.py), "required" or {"type": "function", "function":
    # {"name": ...}} (tool_choice.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # False: tool_choice "required" makes one call
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables

    @property
    def uses_tools(self) -> bool:
        """Tools given and not turned off: they go to the template, calls are parsed (or, for
        "required" or a named function, constrained)."""
        return bool(self.tools) and self.tool_choice != "none"

    def field_name(self, param: str) -> str:
        """Chat's own names: top_logprobs is SamplingParams' logprobs, and
        max_completion_tokens (when given) its max_tokens."""
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().field_name(param)


class TokenizeRequest(_NullIsDefault):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
