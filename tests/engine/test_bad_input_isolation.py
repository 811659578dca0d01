"""Bad input while other requests run, on each surface: the engine under LLM (LLMEngine), the
async engine with its core in a process of its own, and the OpenAI server. A refused request
gets an error naming the problem, takes no KV block, and leaves the running requests alone:
they finish with the outputs they give without it, and afterwards every block is free. A
grammar xgrammar fails to compile ends its own request only; a broken checkpoint, found in the
core process, is the loader's error (naming the file) and leaves no process behind.

The single-request cases (each error's wording, LLM.generate refusing a batch before any step)
are in tests/entrypoints/test_llm.py, test_llm_args.py, test_async_llm.py and
test_openai_server.py; this file checks the isolation and the block count around them."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    NEVER_COMPILES,
    answers,
    child_processes,
    load_script,
    slow_steps_failing_grammar,
    wait_gone,
)

from llm_inference import LLM, AsyncLLM, SamplingParams
from llm_inference import StructuredOutputsParams as S
from llm_inference.config import CheckpointError
from llm_inference.structured_output import manager as manager_module

# tests/entrypoints/conftest.py (its live-server helpers) under a name of its own: `conftest`
# is whichever conftest pytest imported last
server_helpers = load_script(
    Path(__file__).parents[1] / "entrypoints" / "conftest.py", "entrypoints_conftest"
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# (request id, prompt ids, params, exception, message): each refused by LLMEngine.add_request
BAD_REQUESTS = [
    ("empty", [], GREEDY, ValueError, r"^the prompt is empty$"),
    ("too_long", [5] * 600, GREEDY, ValueError,
     r"^the prompt has 600 tokens, which leaves no room to generate within max_model_len=512$"),
    ("no_room", [5] * 500, GREEDY.replace(max_tokens=20), ValueError,
     r"^500 prompt tokens \+ max_tokens=20 = 520 exceeds max_model_len=512$"),
    ("vocab", [5, 999], GREEDY, ValueError,
     r"^token ids must be integers in \[0, 320\); got \[999\]$"),
    ("bias", [5], GREEDY.replace(logit_bias={999: 1.0}), ValueError,
     r"^logit_bias holds token ids outside the vocabulary \[0, 320\): \[999\]$"),
    ("grammar", [5], SamplingParams(structured_outputs=S(grammar="root ::= nope")), ValueError,
     r'^structured_outputs.grammar: EBNF parser error .*Rule "nope" is not defined'),
    ("regex", [5], SamplingParams(structured_outputs=S(regex="a(")), ValueError,
     r"^structured_outputs.regex: Regex parsing error"),
    ("params", [5], {"temperature": -1.0}, TypeError,
     r"^sampling_params must be SamplingParams, not dict$"),
]  # fmt: skip
# the requests that run meanwhile: greedy, n=2 seeded, and a constrained one (seeded)
GOOD = [
    ("a", [5, 6, 7], GREEDY),
    ("b", list(range(10, 40)), SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12)),
    ("c", [8, 9], SamplingParams(temperature=1.0, seed=3, max_tokens=16,
                                 structured_outputs=S(choice=["yes please", "no", "maybe"]))),
]  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        yield llm


def test_engine_refuses_bad_requests_while_others_run(llm):
    """Every refusal while three requests are mid-answer (one with n=2, one constrained): the
    error names the problem, nothing of the refused request is kept and it takes no block; a
    second request under a running id is refused without touching the first. The running
    ones give the answers they give alone, and every block is free afterwards."""
    engine = llm.engine
    alone = answers(llm.generate([g[1] for g in GOOD], [g[2] for g in GOOD], use_tqdm=False))
    for rid, ids, params in GOOD:
        engine.add_request(rid, ids, params)
    outs = {}
    while len(engine.scheduler.requests["a"].output_token_ids) < 3:
        outs.update((o.request_id, o) for o in engine.step())
    stats = llm.stats()
    assert stats["num_running_requests"] == 4  # a, b's two completions and c: all mid-answer
    held = stats["num_kv_blocks"] - stats["num_free_kv_blocks"]
    assert held > 0
    cases = [
        *BAD_REQUESTS,
        ("a", [5, 6], GREEDY, ValueError, r"^request id 'a' is already running$"),
    ]
    for rid, ids, params, exc, message in cases:
        with pytest.raises(exc, match=message):
            engine.add_request(rid, ids, params)
        if rid != "a":
            assert rid not in engine.output_processor and rid not in engine.scheduler.requests
        stats = llm.stats()
        assert stats["num_kv_blocks"] - stats["num_free_kv_blocks"] == held, rid
        assert stats["num_unfinished_requests"] == 4, rid
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    engine.step()  # the last finished ids reach the workers
    assert answers([outs[g[0]] for g in GOOD]) == alone
    assert all(c.finish_reason == "length" for c in outs["a"].outputs + outs["b"].outputs)
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert not engine.output_processor.requests and not engine.scheduler.requests


def test_a_grammar_failing_to_compile_ends_only_its_request(llm, monkeypatch, capsys):
    """xgrammar failing on a spec that parsed (check_spec passes it): both completions of that
    request end with "abort", no tokens and the error, naming the spec, as their stop_reason;
    the core says why too, the requests beside it finish as they do alone, and nothing is left:
    no block, no request, no grammar compiling."""
    failing = S(regex=r"[0-9]{4}-never")
    real = manager_module.compile_grammar

    def compile_grammar(compiler, key):
        if key[1] == failing.regex:
            raise RuntimeError("xgrammar ran out of states")
        return real(compiler, key)

    monkeypatch.setattr(manager_module, "compile_grammar", compile_grammar)
    prompts = [[5, 6, 7], [8, 9], list(range(10, 40))]
    params = [GREEDY, SamplingParams(structured_outputs=failing, n=2, seed=1), GOOD[2][2]]
    alone = answers(llm.generate([prompts[0], prompts[2]], [params[0], params[2]],
                                 use_tqdm=False))  # fmt: skip
    first, failed, last = llm.generate(prompts, params, use_tqdm=False)
    why = ("structured_outputs.regex: xgrammar failed to compile the grammar: xgrammar ran out "
           "of states")  # fmt: skip
    assert [(c.finish_reason, c.token_ids, c.stop_reason) for c in failed.outputs] == [
        ("abort", [], why)
    ] * 2
    assert failed.finished
    assert "grammar failed: xgrammar ran out of states" in capsys.readouterr().out
    assert answers([first, last]) == alone
    llm.engine.step()
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_unfinished_requests"] == 0
    assert not llm.engine.core.structured.compiling


def test_async_llm_refusals_leave_the_streams_alone(tiny_ckpt):
    """AsyncLLM with its core in a process of its own (steps slowed, so the streams are still
    running when the refusals come): each bad request raises its own error, text prompts too
    (an empty string is an empty prompt), and so does a grammar that fails to compile in the
    core (both of its n=2 completions ended there); the streams finish with the answers they
    give alone, the engine runs on, and every block is free afterwards."""
    prompts = ["Hello world", "Paris is the capital", "The quick brown fox"]
    # 40 slowed steps: the streams outlast the refusals even on a loaded machine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    text_cases = [("", r"^the prompt is empty$"),
                  ("Hello " * 600, r"^the prompt has \d+ tokens, which leaves no room to generate "
                                   r"within max_model_len=512$")]  # fmt: skip
    failing = SamplingParams(structured_outputs=S(regex=f"[0-9]{{4}}-{NEVER_COMPILES}"), n=2)
    bad = [(ids, p, exc, m) for _, ids, p, exc, m in BAD_REQUESTS] + [
        (text, params, ValueError, m) for text, m in text_cases
    ]
    bad.append((prompts[0], failing, ValueError, r"^structured_outputs\.regex: xgrammar failed "
                r"to compile the grammar: xgrammar ran out of states$"))  # fmt: skip

    async def run(llm, refuse: bool):
        progress = {i: 0 for i in range(len(prompts))}

        async def stream(i):
            last = None
            async for out in llm.generate(prompts[i], params, f"good-{i}"):
                progress[i], last = len(out.token_ids), out
            return last

        tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
        if refuse:
            while not all(progress.values()):  # every stream has its first token
                await asyncio.sleep(0.01)
            for prompt, p, exc, message in bad:
                with pytest.raises(exc, match=message):
                    async for _ in llm.generate(prompt, p):
                        pass
            # still running in the engine thread (its table of running requests)
            assert all(f"good-{i}" in llm._streams for i in progress), progress
        return await asyncio.gather(*tasks)

    setup = slow_steps_failing_grammar
    with AsyncLLM(str(tiny_ckpt), core_setup=setup, **server_helpers.ENGINE_ARGS) as llm:
        refused_beside = asyncio.run(run(llm, refuse=True))
        stats = server_helpers.wait_all_blocks_free(llm)
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert stats["num_unfinished_requests"] == 0
        alone = asyncio.run(run(llm, refuse=False))
        assert llm.is_running
    assert answers(refused_beside) == answers(alone)
    assert all(o.outputs[0].finish_reason == "length" for o in refused_beside)


def test_server_bad_requests_beside_a_running_stream(tiny_ckpt):
    """Through the `openai` client while a streamed completion runs: each bad request is a 400
    naming the problem and the field, a grammar that fails to compile in the core too (streamed
    or not, named as the request names its spec); a request of two prompts, one too long, is
    refused whole (its other prompt, started, is aborted: it would otherwise run for seconds);
    the stream
    ends as the same request alone does, and every block is free afterwards."""
    import openai

    h = server_helpers
    srv = h.start_server(tiny_ckpt, core_setup=slow_steps_failing_grammar)
    try:
        client = openai.OpenAI(base_url=srv.v1, api_key=h.API_KEY, max_retries=0)
        # 48 slowed steps (~4 s): the stream outlasts the refusals even on a loaded machine
        kw = dict(model=h.MODEL_NAME, prompt="Hello world", temperature=0.0, max_tokens=48,
                  extra_body={"ignore_eos": True})  # fmt: skip
        stream = iter(client.completions.create(stream=True, **kw))
        first = next(stream)
        text = first.choices[0].text
        bad = [
            (dict(prompt=""), "prompt", "the prompt is empty"),
            (dict(prompt=[5, 999]), "prompt", "token ids must be integers in [0, 320)"),
            (dict(prompt="Hello " * 600), "prompt", "leaves no room to generate within"),
            (dict(prompt=["Hi", "Hello " * 600], max_tokens=None), "prompt", "prompt 1: the"),
            (dict(temperature=-1.0), "temperature", "temperature must be finite and >= 0"),
            (dict(top_p=2.0), "top_p", "top_p must be in (0, 1], got 2.0"),
            (dict(extra_body={"top_k": -5}), "top_k", "top_k must be -1 or 0 (disabled)"),
            (dict(n=0), "n", "n must be an integer >= 1"),
            (dict(max_tokens=0), "max_tokens", "max_tokens must be None or an integer >= 1"),
            (dict(extra_body={"structured_outputs": {"grammar": "root ::= nope"}}),
             "structured_outputs", "structured_outputs.grammar: EBNF parser error"),
            (dict(logit_bias={"999": 1}), "logit_bias",
             "logit_bias holds token ids outside the vocabulary [0, 320): [999]"),
            (dict(extra_body={"allowed_token_ids": [3, 999]}), "allowed_token_ids",
             "allowed_token_ids holds token ids outside the vocabulary [0, 320): [999]"),
            (dict(extra_body={"structured_outputs": {"regex": f"a-{NEVER_COMPILES}"}}),
             "structured_outputs", "structured_outputs.regex: xgrammar failed to compile the "
             "grammar: xgrammar ran out of states"),
            (dict(extra_body={"guided_regex": f"a-{NEVER_COMPILES}"}, stream=True),
             "guided_regex", "guided_regex: xgrammar failed to compile the grammar: "),
            (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"enum": [NEVER_COMPILES]}}}}),
             "response_format", "response_format.json_schema.schema: xgrammar failed to "),
            (dict(prompt=["Hi", "Hello"], extra_body={"guided_regex": f"b-{NEVER_COMPILES}"}),
             "guided_regex", "prompt 0: guided_regex: xgrammar failed to compile the grammar"),
        ]  # fmt: skip
        for case, param, message in bad:
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(**{**kw, "max_tokens": 3, **case})
            err = info.value.body
            assert message in err["message"] and err["param"] == param, (case, err)
        assert f"{first.id}-0" in srv.llm._streams  # the stream still runs in the engine
        chunks = list(stream)
        text += "".join(c.choices[0].text for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        stats = h.wait_all_blocks_free(srv.llm)
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert stats["num_unfinished_requests"] == 0
        assert text == client.completions.create(**kw).choices[0].text
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def broken_ckpts(tiny_ckpt, tmp_path_factory):
    """Copies of the tiny checkpoint that only the weights' loader (in the core process) finds
    broken: a truncated safetensors file, and a config with a layer the weights lack."""
    root = tmp_path_factory.mktemp("broken")
    truncated = shutil.copytree(tiny_ckpt, root / "truncated")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    deeper = shutil.copytree(tiny_ckpt, root / "deeper")
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    return {"truncated": truncated, "deeper": deeper}


def test_broken_weights_found_in_the_core_process(broken_ckpts, capsys):
    """AsyncLLM raises the loader's CheckpointError naming the file or the tensors, as LLM
    does, and leaves no process; `serve` says it in one line and exits 1."""
    from llm_inference.entrypoints.cli import main

    before = {pid for pid, _ in child_processes()}
    path = broken_ckpts["truncated"]
    message = f"cannot read safetensors file {path}/model.safetensors: .*header"
    with pytest.raises(CheckpointError, match=message):
        AsyncLLM(str(path), **server_helpers.ENGINE_ARGS)
    assert not wait_gone([pid for pid, _ in child_processes() if pid not in before], 10)
    capsys.readouterr()
    assert main(["serve", "--model", str(broken_ckpts["deeper"]), "--device", "cpu"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("error: ") and "missing tensors: model.layers.2." in err[0], err
    assert not wait_gone([pid for pid, _ in child_processes() if pid not in before], 10)
