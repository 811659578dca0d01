"""Chat prompts: OpenAI-style messages through the model's chat template, one way for
`LLM.chat`, `llm-inference chat` and the server's chat completions (so all send the same
prompt for the same conversation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_chat_template(value: str | None) -> str | None:
    """A chat template given by the user (vLLM's `--chat-template`): a file's path, read, or
    the Jinja template itself (it has a `{{` or `{%`). ValueError for anything else, naming
    the option: a mistyped path must not pass for a template."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:  # (a long template is no valid path to try first)
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(
        f"chat_template: {value!r} is neither a file nor a Jinja template ({{{{ or {{%)"
    )


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """The text of an OpenAI message's content: a string (None: ""), or a list of
    {"type": "text", "text": ...} parts, concatenated. Any other part (an image, audio, a part
    without a type) raises ValueError naming it: dropping it would answer as if it had not
    been sent."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"content must be a string or a list, not {type(content).__name__}")
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise ValueError(f"a content part must be an object, not {type(part).__name__}")
        kind = part.get("type")
        if kind is None:
            raise ValueError("a content part has no type (text parts only are supported)")
        if kind != "text":
            raise ValueError(f"{kind!r} content parts are not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string `text`")
        texts.append(part["text"])
    return "".join(texts)


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> str:
    """The prompt text of one conversation: each message's content flattened to its text
    (`content_text`; its other keys, such as a tool turn's tool_calls, kept for the template),
    then the chat template (`chat_template`, else the tokenizer's). ValueError for content
    that is not text and for `continue_final_message` with `add_generation_prompt`; a
    template's own errors pass."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt=False")
    flat = [{**m, "content": content_text(m.get("content"))} for m in messages]
    return tokenizer.apply_chat_template(
        flat, add_generation_prompt=add_generation_prompt, tokenize=False,
        continue_final_message=continue_final_message, tools=tools,
        **({} if chat_template is None else {"chat_template": chat_template}),
        **(chat_template_kwargs or {}),
    )  # fmt: skip
