"""The offline API's argument checks: invalid engine arguments fail fast naming the argument;
bad prompts and sampling params fail before any model step; the design's quick-start runs
unchanged on the default model."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from llm_inference import LLM, SamplingParams


def _call_within(fn, timeout: float = 60.0):
    """fn()'s result or exception, from a thread that must finish within `timeout` seconds (a
    hang fails the test instead of stalling the suite)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s"
    return box


BAD_ENGINE_ARGS = [
    ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", -8),
    ("max_num_seqs", 0),
    ("max_num_seqs", -1),
    ("block_size", 0),
    ("block_size", 12),
    ("max_model_len", 0),
    ("max_model_len", -5),
    ("long_prefill_token_threshold", -1),
    ("long_prefill_token_threshold", 2.5),
    ("gpu_memory_utilization", 0.0),
    ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", -0.1),
    ("dtype", "int8"),
    ("device", "tpu"),
    ("kernel_backend", "fast"),
    ("disable_custom_all_reduce", "yes"),
    ("enable_prefix_caching", "no"),
    ("seed", 1.5),
    ("tensor_parallel_size", 0),
    ("kv_cache_memory_bytes", -1),
    ("kv_cache_dtype", "fp8_e5m2"),
]


@pytest.mark.parametrize(
    "name,value", BAD_ENGINE_ARGS, ids=[f"{n}={v}" for n, v in BAD_ENGINE_ARGS]
)
def test_bad_engine_argument_raises_quickly_naming_it(tiny_ckpt, name, value):
    kw = {"device": "cpu", name: value}
    box = _call_within(lambda: LLM(str(tiny_ckpt), **kw), timeout=30)
    err = box.get("error")
    assert isinstance(err, ValueError), box
    assert name in str(err), err


def test_valid_llm_after_bad_arguments(tiny_ckpt):
    for name, value in BAD_ENGINE_ARGS:
        with pytest.raises(ValueError):
            LLM(str(tiny_ckpt), **{"device": "cpu", name: value})
    box = _call_within(lambda: LLM(str(tiny_ckpt), device="cpu", block_size=32), timeout=60)
    with box["value"] as llm:
        out = llm.generate([[5, 6, 7]], max_new_tokens=3, use_tqdm=False)
        assert len(out[0].token_ids) == 3


# The performance choices that are the kernels' business, no engine argument (issue 27).
REMOVED_KNOBS = ("skinny_gemm", "pdl", "fused_all_reduce_norm", "mixed_cuda_graph_sizes")


@pytest.mark.parametrize("name", ["bogus", *REMOVED_KNOBS])
def test_unknown_engine_argument_is_a_type_error_naming_it(tiny_ckpt, name):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        LLM(str(tiny_ckpt), device="cpu", **{name: True})


def test_every_engine_argument_has_a_cli_flag():
    """EngineArgs is the one option list: each field is a flag of generate, chat, serve and
    bench, and reads back as what was given."""
    from llm_inference.engine.arg_utils import EngineArgs
    from llm_inference.entrypoints.cli import build_parser

    parser = build_parser()
    fields = dataclasses.fields(EngineArgs)
    assert {f.name for f in fields} >= {"model", "device", "dtype", "enforce_eager"}
    for command in (["generate", "hi"], ["chat"], ["serve"], ["bench", "latency"]):
        for f in fields:
            flag = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                argv = [f"--no-{flag[2:]}" if f.default else flag]
                want = not f.default
            else:
                value = {
                    "dtype": "float16",
                    "device": "cuda:1",
                    "kernel_backend": "triton",
                    "model": "some/folder",
                    "gpu_memory_utilization": 0.25,
                    "distributed_executor_backend": "ray",
                    "quantization": "fp8",
                    "kv_cache_dtype": "fp8",
                }.get(f.name, 3)
                argv, want = [flag, str(value)], value  # fmt: skip
            args = parser.parse_args([*command, *argv])
            assert getattr(EngineArgs.from_cli_args(args), f.name) == want, (command, flag)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        yield llm


BAD_PROMPTS = [
    # (prompts, sampling_params, keyword args, exception, message)
    ([[5, 6.5]], None, {}, ValueError, r"prompt 0: token ids must be integers .*got \[6.5\]"),
    ([[5, True]], None, {}, ValueError, r"prompt 0: token ids must be integers .*got \[True\]"),
    (np.array([5, 6, 7]), None, {}, TypeError, r"not ndarray; pass token ids as a list"),
    (np.array([[5, 6, 7]]), None, {}, TypeError, r"not ndarray.*\.tolist\(\)"),
    (torch.tensor([5, 6, 7]), None, {}, TypeError, r"not Tensor; pass token ids as a list"),
    ([np.array([5, 6])], None, {}, TypeError, r"prompt 0 must be .* not ndarray; use \.tolist"),
    ([np.float32(5.0)], None, {}, TypeError, r"prompt 0 must be a string, a list of token ids"),
    (None, None, {}, TypeError, r"prompts must be a string, .* not NoneType"),
    ([None], None, {}, TypeError, r"prompt 0 must be .* or a prompt dict, not NoneType"),
    (["a", 5], None, {}, TypeError, r"prompt 1 is a token id among strings or lists"),
    ([[5, 6]], {"temperature": 0.5}, {}, TypeError, r"sampling_params must be a SamplingParams"),
    ([[5, 6]], "greedy", {}, TypeError, r"sampling_params must be a SamplingParams or a list"),
    ([[5, 6]], [{"temperature": 0}], {}, TypeError, r"sampling_params\[0\] must be a Sampl"),
    ([[5], [6]], [SamplingParams()], {}, ValueError, r"got 1 sampling_params for 2 prompts"),
    ([[5]], [SamplingParams()] * 3, {}, ValueError, r"got 3 sampling_params for 1 prompts"),
    ([[5, 6]], None, {"max_new_tokens": 0}, ValueError, r"max_new_tokens must be at least 1"),
    ([[5, 6]], None, {"max_new_tokens": 2.5}, TypeError, r"max_new_tokens must be an integer"),
    (
        [{"prompt": "a", "multi_modal_data": {}}],
        None,
        {},
        ValueError,
        r"prompt 0: unsupported keys \['multi_modal_data'\]",
    ),
    (
        [[5], {"prompt": "a", "prompt_token_ids": [5]}],
        None,
        {},
        ValueError,
        r"prompt 1: give 'prompt' or 'prompt_token_ids', not both",
    ),
    ({}, None, {}, ValueError, r"prompt 0: give 'prompt' or 'prompt_token_ids'"),
    ([{"prompt": [5, 6]}], None, {}, TypeError, r"prompt 0: 'prompt' must be a string, not list"),
    (
        [{"prompt_token_ids": np.array([5])}],
        None,
        {},
        TypeError,
        r"'prompt_token_ids' must be a list of token ids, not ndarray; use \.tolist",
    ),
    ([{"prompt_token_ids": [5, "x"]}], None, {}, ValueError, r"prompt 0: token ids must be"),
    (
        [[5]],
        SamplingParams(logit_bias={10**6: 1.0}),
        {},
        ValueError,
        r"prompt 0: logit_bias holds token ids outside the vocabulary \[0, \d+\): \[1000000\]",
    ),
    (
        [[5]],
        SamplingParams(allowed_token_ids=[3, 10**6]),
        {},
        ValueError,
        r"prompt 0: allowed_token_ids holds token ids outside the vocabulary",
    ),
]
BAD_PROMPT_IDS = [
    "float_id", "bool_id", "numpy_array", "numpy_2d", "tensor", "list_of_arrays",
    "numpy_float", "None", "list_of_None", "str_and_int", "dict_params", "str_params",
    "list_of_dicts", "too_few_params", "too_many_params", "max_new_tokens_0",
    "max_new_tokens_float", "dict_unsupported_key", "dict_both_keys", "dict_empty",
    "dict_prompt_not_text", "dict_ids_array", "dict_bad_id", "logit_bias_vocab",
    "allowed_vocab",
]  # fmt: skip


@pytest.mark.parametrize("prompts,params,kw,exc,match", BAD_PROMPTS, ids=BAD_PROMPT_IDS)
def test_bad_prompt_or_params_fails_before_any_step(llm, prompts, params, kw, exc, match):
    steps = llm.stats()["num_steps"]
    with pytest.raises(exc, match=match):
        llm.generate(prompts, params, use_tqdm=False, **kw)
    stats = llm.stats()
    assert stats["num_steps"] == steps
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert len(llm.generate([[5, 6, 7]], max_new_tokens=2, use_tqdm=False)[0].token_ids) == 2


def test_each_prompt_is_checked_once(llm, monkeypatch):
    """Each prompt is checked once (each check is three passes over the prompt), where it
    enters: LLMEngine.add_request, which LLM.generate calls; add_request alone checks too."""
    calls = []
    check = llm.engine.validate_request
    monkeypatch.setattr(
        llm.engine, "validate_request", lambda ids, p: (calls.append(len(ids)), check(ids, p))
    )
    llm.generate([[5, 6, 7], [8] * 40], max_new_tokens=2, use_tqdm=False)
    assert calls == [3, 40]
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.engine.add_request("direct", [5, -1], SamplingParams(max_tokens=2))
    assert calls[2:] == [2] and llm.stats()["num_unfinished_requests"] == 0


def test_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt dicts work as its users pass them: alone, in a list,
    mixed with plain prompts; outputs equal those of the plain prompts."""
    tok = llm.get_tokenizer()
    ids = tok("Hello there").input_ids
    want = llm.generate(["Hello there", [5, 6, 7]], max_new_tokens=4, use_tqdm=False)
    got = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": (5, 6, 7)}],
                       max_new_tokens=4, use_tqdm=False)  # fmt: skip
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].prompt == "Hello there" and got[0].prompt_token_ids == ids
    assert got[1].prompt is None and got[1].prompt_token_ids == [5, 6, 7]
    (alone,) = llm.generate({"prompt_token_ids": ids}, max_new_tokens=4, use_tqdm=False)
    assert alone.token_ids == want[0].token_ids


def test_truncate_prompt_tokens(llm):
    """The prompt's last k tokens run (and are reported), as if given alone; -1 keeps the last
    max_model_len, which then leaves no room to generate: a clear error."""
    long = [5 + i % 200 for i in range(700)]  # beyond max_model_len (512)
    params = SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=100)
    (out,) = llm.generate([long], params, use_tqdm=False)
    (want,) = llm.generate([long[-100:]], max_new_tokens=6, use_tqdm=False)
    assert out.prompt_token_ids == long[-100:] and out.token_ids == want.token_ids
    with pytest.raises(ValueError, match="prompt 0: .*512"):
        llm.generate([long], params.replace(truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: .*512"):
        llm.generate([long], params.replace(truncate_prompt_tokens=None), use_tqdm=False)


def test_numpy_and_torch_integer_token_ids_are_accepted_as_ints(llm):
    """Lists of integer scalars of any kind are token ids (as vLLM takes lists of ints): numpy
    and 0-d torch integers become plain ints. Whole arrays / tensors are refused above."""
    want = llm.generate([[5, 6, 7], [8, 9]], max_new_tokens=3, use_tqdm=False)
    arr = np.array([5, 6, 7], dtype=np.int64)
    for prompts in (
        [list(arr), list(np.array([8, 9], dtype=np.int32))],
        [arr.tolist(), (8, 9)],
        [list(torch.tensor([5, 6, 7])), [torch.tensor(8), np.int16(9)]],
    ):
        outs = llm.generate(prompts, max_new_tokens=3, use_tqdm=False)
        assert [o.token_ids for o in outs] == [w.token_ids for w in want]
        assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9]]
        assert all(type(t) is int for o in outs for t in o.prompt_token_ids)
    one = llm.generate(list(arr), max_new_tokens=3, use_tqdm=False)  # one prompt of ids
    assert one[0].token_ids == want[0].token_ids


def test_quick_start_on_the_default_model(capsys):
    """The design's quick-start, unchanged: no max_model_len, so the engine lowers the model's
    8192 positions to what 64 MiB of KV cache holds, and says so in one line. Not marked slow:
    1-3 s on 2 idle CPU cores once the default model's conversion is cached."""
    with LLM(kv_cache_memory_bytes=64 * 1024**2) as llm:
        outs = llm.generate(["The capital of France is"], max_new_tokens=8)
        m, block = llm.config.model, llm.config.cache.block_size
        itemsize = getattr(torch, llm.config.dtype).itemsize
        per_block = 2 * block * m.num_key_value_heads * m.head_dim * m.num_hidden_layers * itemsize
        fits = (64 * 1024**2 // per_block) * block
        assert llm.config.scheduler.max_model_len == fits < m.max_position_embeddings
        assert llm.stats()["num_kv_blocks"] * block == fits
    assert len(outs) == 1 and len(outs[0].token_ids) == 8 and outs[0].text
    lines = [line for line in capsys.readouterr().out.splitlines() if "max_model_len" in line]
    assert lines == [
        f"llm_inference: max_model_len lowered from {m.max_position_embeddings} to {fits} "
        f"tokens, all that the KV cache ({fits // block} blocks) holds"
    ]
