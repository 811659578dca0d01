"""The server against requests an audit found it mishandled: an unbounded `n`, a request's own
chat template, CPU work on the event loop, dropped image parts, refused nulls, lone
surrogates and unexpected exceptions (text/plain 500s), and errors naming the wrong field.
Each answer is checked for its status and the field its error names."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import API_KEY, MODEL_NAME

from llm_inference.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    content_text,
)
from llm_inference.entrypoints.openai.serving import TEMPLATE_ARGUMENTS

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3}


def post(server, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60, **kw)


def error(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI-format error of a response that must have `status`."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def serving(server):
    """The server's OpenAIServing (uvicorn's config holds the app)."""
    return server.server.config.app.state.serving


def test_n_is_bounded(live_server):
    """n is at most 128 (OpenAI's limit): a huge n would fan out on the engine's one front-end
    thread and hang every request."""
    for n in (129, 0, 1 << 40):
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            err = error(post(live_server, path, {**body, "n": n}))
            assert err["param"] == "n" and "n must be an integer >= 1 and <= 128" in err["message"]
    r = post(live_server, "/v1/completions", {**COMPLETION, "n": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_chat_template_kwargs_cannot_set_the_templates_arguments(live_server, monkeypatch):
    """chat_template_kwargs adds template variables; it may not replace the server's template
    (or tokenize, messages, ... any argument of apply_chat_template)."""
    template = "{% for i in range(10**9) %}y{% endfor %}"  # what a request could run
    for key in sorted(TEMPLATE_ARGUMENTS):
        err = error(post(live_server, "/v1/chat/completions",
                         {**CHAT, "chat_template_kwargs": {key: template}}))  # fmt: skip
        assert err["param"] == "chat_template_kwargs" and repr(key) in err["message"], key
    # an ordinary template variable still reaches the template
    tok = SpyTokenizer(serving(live_server).tokenizer)
    monkeypatch.setattr(serving(live_server), "tokenizer", tok)
    r = post(live_server, "/v1/chat/completions",
             {**CHAT, "chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    assert r.status_code == 200 and tok.template_kwargs[-1]["enable_thinking"] is True


class SpyTokenizer:
    """The server's tokenizer, recording the keyword arguments of apply_chat_template; and
    tokenizing or templating text that holds MARKER sets `entered`, then blocks until
    `release` is set."""

    MARKER = "BLOCK-HERE"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs: list[dict] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def _block(self, text) -> None:
        if self.MARKER in str(text):
            self.entered.set()
            self.release.wait(60)

    def __call__(self, text, **kwargs):
        self._block(text)
        return self.tokenizer(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self.template_kwargs.append(kwargs)
        self._block(messages)
        return self.tokenizer.apply_chat_template(messages, **kwargs)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {**COMPLETION, "prompt": SpyTokenizer.MARKER}),
        ("/v1/chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": SpyTokenizer.MARKER}]}),
        ("/tokenize", {"prompt": SpyTokenizer.MARKER}),
    ],
    ids=["completions", "chat", "tokenize"],
)  # fmt: skip
def test_tokenizing_runs_off_the_event_loop(live_server, monkeypatch, path, body):
    """While one request's prompt is being tokenized (held there by SpyTokenizer), /health
    and a small request are answered: the tokenizer does not run on the event loop. (On the
    loop, nothing is answered until the tokenizer returns: /health times out.)"""
    tok = SpyTokenizer(serving(live_server).tokenizer)
    monkeypatch.setattr(serving(live_server), "tokenizer", tok)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, live_server, path, body)
        try:
            assert tok.entered.wait(30), "the request never reached the tokenizer"
            assert httpx.get(live_server.url + "/health", timeout=10).status_code == 200
            small = httpx.post(live_server.v1 + "/completions", json=COMPLETION,
                               headers=HEADERS, timeout=10)  # fmt: skip
            assert small.status_code == 200 and not tok.release.is_set()
        finally:
            tok.release.set()
        assert slow.result().status_code == 200


def test_content_text():
    """The flattening of OpenAI message content that chat (and later LLM.chat) uses."""
    assert content_text("hi") == "hi" and content_text(None) == ""
    parts = [{"type": "text", "text": "what "}, {"type": "text", "text": "is"}]
    assert content_text(parts) == "what is" and content_text([]) == ""
    for part, name in (
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "'image_url'"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "'input_audio'"),
        ({"text": "untyped"}, "no type"),
        ({"type": "text"}, "string `text`"),
    ):
        with pytest.raises(ValueError, match=name):
            content_text([{"type": "text", "text": "what is"}, part])
    for content in (["what is"], 42):  # what LLM.chat could be handed
        with pytest.raises(ValueError, match="must be"):
            content_text(content)


def test_non_text_content_parts_are_refused(live_server):
    """An image (or audio, or untyped) part is a 400 naming it, not an answer without it;
    text parts are read as the string they make up."""
    text = [{"type": "text", "text": "what is"}]
    for part, name in (
        ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
        ({"text": "untyped"}, "no type"),
    ):
        messages = [{"role": "user", "content": text + [part]}]
        for path in ("/v1/chat/completions", "/tokenize"):
            body = {**CHAT, "messages": messages} if path != "/tokenize" else {"messages": messages}
            err = error(post(live_server, path, body))
            assert err["param"] == "messages" and name in err["message"]
    as_parts = post(live_server, "/tokenize", {"messages": [{"role": "user", "content": text}]})
    as_string = post(live_server, "/tokenize",
                     {"messages": [{"role": "user", "content": "what is"}]})  # fmt: skip
    assert as_parts.json()["tokens"] == as_string.json()["tokens"]


def _nulls(model) -> dict:
    """Every field of `model` that has a default other than None, as null."""
    return {k: None for k, f in model.model_fields.items()
            if not f.is_required() and f.default is not None}  # fmt: skip


def test_null_means_the_default(live_server):
    """An explicit null for a field with a default is that default (as OpenAI and vLLM read
    it): the same answer as the request without those fields; a required field's null is
    still a 400 naming it."""
    assert {"temperature", "top_p", "n", "stream", "echo"} <= set(_nulls(CompletionRequest))
    assert {"logprobs", "presence_penalty"} <= set(_nulls(ChatCompletionRequest))
    for path, body, model in (("/v1/completions", COMPLETION, CompletionRequest),
                              ("/v1/chat/completions", CHAT, ChatCompletionRequest)):  # fmt: skip
        body = {**body, "seed": 11}
        plain = post(live_server, path, body)
        nulls = post(live_server, path, {**body, **_nulls(model), "stream_options": None})
        assert plain.status_code == nulls.status_code == 200, nulls.text
        assert plain.json()["choices"] == nulls.json()["choices"]
    r = post(live_server, "/v1/chat/completions",
             {**CHAT, "stream": True, "stream_options": {"include_usage": None}})  # fmt: skip
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    err = error(post(live_server, "/v1/completions", {**COMPLETION, "prompt": None}))
    assert err["param"] == "prompt"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 3}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "hi \\udfff"], "max_tokens": 3}', "prompt"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 3}', "messages"),
        ("/tokenize", '{"prompt": "hi \\ud800"}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages"),
    ],
)  # fmt: skip
def test_lone_surrogate_is_a_400(live_server, path, body, param):
    """JSON can carry a lone surrogate (\\ud800), which the tokenizer refuses with TypeError:
    a 400 naming the prompt, not a text/plain 500."""
    r = httpx.post(live_server.url + path, content=body, timeout=60,
                   headers={**HEADERS, "Content-Type": "application/json"})  # fmt: skip
    err = error(r)
    assert err["param"] == param and "lone surrogate" in err["message"]


def test_unexpected_exception_is_a_json_500_and_logged(live_server, monkeypatch):
    """A bug (any exception the server does not expect) is a 500 in OpenAI's format, and the
    server logs it with its traceback."""
    records = []
    logged = threading.Event()

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and isinstance(record.exc_info[1], RuntimeError):
                records.append(record)
                logged.set()

    def boom(name):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(serving(live_server), "check_model", boom)
    handler, log = Catch(), logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        r = httpx.get(live_server.v1 + "/models/x", headers=HEADERS, timeout=60)
        err = error(r, 500)
        assert err["type"] == "server_error" and "kaboom" in err["message"]
        assert logged.wait(10) and "kaboom" in str(records[0].exc_info[1])
    finally:
        log.removeHandler(handler)


def test_max_completion_tokens_zero_is_refused(live_server):
    """max_completion_tokens 0 is a 400 as max_tokens 0 is, not "fill the context"."""
    err = error(post(live_server, "/v1/chat/completions",
                     {**CHAT, "max_tokens": None, "max_completion_tokens": 0}))  # fmt: skip
    assert err["param"] == "max_completion_tokens"
    r = post(live_server, "/v1/chat/completions",
             {**CHAT, "max_tokens": None, "max_completion_tokens": 2})  # fmt: skip
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_stream_options_needs_stream(live_server):
    """stream_options without stream=true is a 400 naming it, as vLLM answers."""
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        for stream in ({}, {"stream": False}):
            body = {**body, **stream, "stream_options": {"include_usage": True}}
            assert error(post(live_server, path, body))["param"] == "stream_options"


def test_beam_search_checks_the_length_as_a_plain_request(live_server):
    """use_beam_search with prompt + max_tokens over max_model_len is the 400 a plain request
    gets, not an answer cut short."""
    body = {**COMPLETION, "prompt": [1] * 500, "max_tokens": 20}
    plain = error(post(live_server, "/v1/completions", body))
    beam = error(post(live_server, "/v1/completions", {**body, "use_beam_search": True}))
    assert beam == plain and "exceeds max_model_len=512" in beam["message"]
    # of several prompts, the one it is about, counted from 0 as LLM.generate's errors count
    body = {**body, "prompt": [[1, 2], [1] * 500]}
    plain = error(post(live_server, "/v1/completions", body))
    beam = error(post(live_server, "/v1/completions", {**body, "use_beam_search": True}))
    assert beam == plain and beam["message"].startswith("prompt 1: "), beam


@pytest.mark.parametrize(
    "path,body,param,message",
    [
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "top_logprobs must be"),
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "n": 11}, "n",
         "n must be an integer in [1, 10]"),
        ("/v1/completions", {**COMPLETION, "use_beam_search": True, "length_penalty": "nan"},
         "length_penalty", "length_penalty must be a finite number"),
        ("/v1/completions", {**COMPLETION, "structured_outputs": {"foo": 1}},
         "structured_outputs", "structured_outputs: unknown keys"),
    ],
    ids=["top_logprobs", "beam width", "length_penalty", "structured_outputs"],
)  # fmt: skip
def test_errors_name_the_requests_field(live_server, path, body, param, message):
    err = error(post(live_server, path, body))
    assert err["param"] == param and err["message"].startswith(message)


def test_malformed_json_names_no_field(live_server):
    """A body that is not JSON names no field (not the character offset where it broke)."""
    r = httpx.post(live_server.v1 + "/completions", content=b'{"prompt": "hi", ', timeout=60,
                   headers={**HEADERS, "Content-Type": "application/json"})  # fmt: skip
    err = error(r)
    assert err["param"] is None and "not valid JSON" in err["message"]


def test_a_json_body_is_read_whatever_its_content_type(live_server):
    """curl -d sends application/x-www-form-urlencoded; vLLM reads the JSON body regardless."""
    import json

    for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
        headers = {**HEADERS, **({"Content-Type": content_type} if content_type else {})}
        r = httpx.post(live_server.url + "/v1/completions", content=json.dumps(COMPLETION),
                       headers=headers, timeout=60)  # fmt: skip
        assert r.status_code == 200, (content_type, r.text)
        assert r.json()["choices"][0]["text"] is not None
    err = error(httpx.post(live_server.url + "/v1/completions", content=b"prompt=Hi",
                           headers=HEADERS, timeout=60))  # fmt: skip
    assert "not valid JSON" in err["message"]


@pytest.mark.parametrize(
    "field, value",
    [("stop", ["s"] * 17), ("bad_words", ["w"] * 1025), ("stop_token_ids", [1] * 1025),
     ("allowed_token_ids", [1] * 16385), ("logit_bias", {str(i): 1 for i in range(1025)}),
     ("guided_choice", ["c"] * 1025), ("structured_outputs", {"choice": ["c"] * 1025})],
)  # fmt: skip
def test_list_fields_are_bounded(live_server, field, value):
    """Each entry of these lists costs every stream time (front-end tokenizing, a per-step mask,
    a per-token stop search): above its bound a request is a 400 naming the field."""
    err = error(post(live_server, "/v1/completions", {**COMPLETION, field: value}))
    assert err["param"] == field and "at most" in err["message"], err


def test_prompts_per_request_are_bounded(live_server):
    err = error(post(live_server, "/v1/completions", {**COMPLETION, "prompt": ["hi"] * 1025}))
    assert err["param"] == "prompt" and "at most 1024 prompts" in err["message"]
    r = post(live_server, "/v1/completions", {**COMPLETION, "prompt": ["hi"] * 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


@pytest.mark.parametrize(
    "field, value, param",
    [("stop", ["\ud800"], "stop"), ("bad_words", ["a\ud800"], "bad_words"),
     ("structured_outputs", {"choice": ["\udc00x"]}, "structured_outputs"),
     ("guided_choice", ["\udc00"], "guided_choice")],
)  # fmt: skip
def test_lone_surrogates_name_their_field(live_server, field, value, param):
    """JSON's \\ud800 escapes carry lone surrogates: a 400 naming the field they are in (not
    the tokenizer's TypeError under `prompt`)."""
    import json

    body = json.dumps({**COMPLETION, field: value}).encode()  # \\ud800 escapes, as JSON allows
    r = httpx.post(live_server.url + "/v1/completions", content=body,
                   headers={**HEADERS, "Content-Type": "application/json"}, timeout=60)  # fmt: skip
    err = error(r)
    assert err["param"] == param and "valid Unicode" in err["message"], err
