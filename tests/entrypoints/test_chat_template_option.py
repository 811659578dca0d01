"""A chat template of the user's instead of the tokenizer's (vLLM's `serve --chat-template` and
`LLM.chat(chat_template=...)`): a file or the template itself; the prompt the engine gets is
that template's rendering, offline, through the server's chat completions and its /tokenize;
a value that is neither a file nor a template is refused naming the option, before the model
loads."""

from __future__ import annotations

import httpx
import pytest
from conftest import serving

from llm_inference.entrypoints.chat_template import load_chat_template
from llm_inference.entrypoints.cli import main

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = "[system] Be brief.\n[user] Hi there\n[assistant] "


def test_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    long = TEMPLATE + "{# " + "x" * 5000 + " #}"  # longer than a file name may be
    assert load_chat_template(long) == long
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="chat_template: .*neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_llm_chat_renders_with_the_given_template(offline_llm, tmp_path):
    ids = offline_llm.tokenizer(RENDERED, add_special_tokens=False).input_ids
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    for template in (TEMPLATE, str(path)):
        (out,) = offline_llm.chat(MESSAGES, max_new_tokens=2, use_tqdm=False,
                                  chat_template=template)  # fmt: skip
        assert out.prompt_token_ids == ids
    (default,) = offline_llm.chat(MESSAGES, max_new_tokens=2, use_tqdm=False)
    assert default.prompt_token_ids != ids  # the tokenizer's own template differs


@pytest.fixture(scope="module")
def templated_server(live_server):
    """What `serve --chat-template TEMPLATE` builds, over the module's engine, on a port of
    its own."""
    from llm_inference.entrypoints.openai.api_server import build_app

    with serving(build_app(live_server.llm, "tiny", chat_template=TEMPLATE)) as url:
        yield url


def test_the_server_renders_chats_with_it(templated_server, live_server):
    ids = live_server.llm.tokenizer(RENDERED, add_special_tokens=False).input_ids
    r = httpx.post(f"{templated_server}/tokenize", json={"messages": MESSAGES}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0.0}
    r = httpx.post(f"{templated_server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # a request's own template is refused, not ignored
    r = httpx.post(f"{templated_server}/v1/chat/completions",
                   json={**body, "chat_template": "{{ messages }}"}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "chat_template is not supported" in r.text


def test_serve_refuses_a_missing_template_file_before_loading(tmp_path, capsys, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was started")

    monkeypatch.setattr("llm_inference.entrypoints.openai.api_server.AsyncLLM", no_engine)
    assert main(["serve", "--chat-template", str(tmp_path / "chat.jinja")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: chat_template:") and "chat.jinja" in err
