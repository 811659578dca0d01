"""Request bodies of the OpenAI-compatible API (pydantic), and the OpenAI error format.

Field names and defaults follow OpenAI's API (`logit_bias` and completions' `echo` included);
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`, `allowed_token_ids`,
`truncate_prompt_tokens`, `prompt_logprobs`, `bad_words`, `structured_outputs` (choice
only; or the older `guided_choice`), `use_beam_search` and `length_penalty` are extra fields,
as vLLM accepts them. Chat takes `tools` (parsed from the answer as Llama 3 writes calls:
tool_parser.py). Fields of UNSUPPORTED (other structured outputs, `best_of`, ...) are refused
with a 400 naming them; other unknown fields are ignored. Values are range-checked by
`SamplingParams` (and `BeamSearchParams`), whose errors name the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error to answer in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)  # fmt: skip

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields of OpenAI's or vLLM's API that this server does not implement: a request that sets
# one (to anything but an off value) gets a 400 naming it, not an answer that ignored it.
UNSUPPORTED = ("response_format", "guided_json", "guided_regex", "guided_grammar", "functions",
               "function_call", "best_of", "suffix", "logits_processors")  # fmt: skip


def _is_off(field: str, value: Any) -> bool:
    """Whether an UNSUPPORTED field's value asks for nothing (what clients send by default)."""
    if value is None or value is False or value in ("", [], {}):
        return True
    if field == "best_of":
        return type(value) is int and value == 1
    return field == "response_format" and value == {"type": "text"}


class _SamplingFields(BaseModel):
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
    # vLLM's structured outputs: {"choice": [...]} (other kinds are refused), or the older
    # guided_choice
    structured_outputs: dict[str, Any] | None = None
    guided_choice: list[str] | None = None
    # vLLM's beam search: the n best beams (beam_search.py), scored with length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> str | None:
        """The first UNSUPPORTED field this request sets, or None."""
        extra = self.model_extra or {}
        return next((k for k in UNSUPPORTED if k in extra and not _is_off(k, extra[k])), None)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text: a string, or the concatenated text parts of a list."""
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last (assistant) message
    tools: list[dict[str, Any]] | None = None  # given to the chat template
    tool_choice: str | dict[str, Any] | None = None  # "auto" or "none" (tool_parser.py)

    @property
    def uses_tools(self) -> bool:
        """Tools given and not turned off: they go to the template, calls are parsed."""
        return bool(self.tools) and self.tool_choice != "none"

    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables


class TokenizeRequest(BaseModel):
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
