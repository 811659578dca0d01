"""LLM.generate on a tiny random model: parity with transformers' greedy generate, under
preemption and small batches, bad inputs, and block accounting."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_model

from llm_inference import LLM, SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 1, 9, 25, 60, 5, 33, 12][:n]
    return [torch.randint(2, 320, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def hf_greedy(tiny_ckpt):
    ref = hf_model(tiny_ckpt)
    out = []
    for p in _prompts():
        ids = ref.generate(
            torch.tensor([p]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def _skip_without(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


# 8 blocks of 16 tokens: 8 prompts of up to 72 tokens cannot all fit at once.
SMALL_CACHE = dict(kv_cache_memory_bytes=8 * 8192, max_model_len=80)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        SMALL_CACHE,
        dict(max_num_seqs=2),
        dict(max_num_batched_tokens=16, kv_cache_memory_bytes=12 * 8192, max_model_len=80),
        dict(long_prefill_token_threshold=3),  # every prompt in chunks of 3, side by side
    ],
    ids=["default", "preempting", "max_num_seqs_2", "chunked_prefill", "long_prefill_chunks"],
)
def test_greedy_matches_transformers(tiny_ckpt, hf_greedy, device, engine_kw):
    _skip_without(device)
    kw = dict(engine_kw, device=device, dtype="float32")
    if device == "cuda":
        kw["kernel_backend"] = "reference"  # float32 parity; Triton vs reference: kernels tests
    with LLM(str(tiny_ckpt), **kw) as llm:
        outs = llm.generate(_prompts(), max_new_tokens=12, use_tqdm=False)
        stats = llm.stats()
        assert [o.token_ids for o in outs] == hf_greedy
        assert all(o.finish_reason == "length" for o in outs)
        if engine_kw is SMALL_CACHE:
            assert stats["num_preemptions"] > 0
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_outputs_in_input_order_with_text(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        prompts = ["Hello world", "The quick brown fox jumps over the lazy dog."]
        outs = llm.generate(prompts, max_new_tokens=5, use_tqdm=False)
        assert [o.prompt for o in outs] == prompts
        for o in outs:
            assert o.prompt_token_ids == llm.tokenizer(o.prompt).input_ids
            assert len(o.token_ids) == 5
            assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        single = llm.generate(prompts[1], max_new_tokens=5, use_tqdm=False)
        assert single[0].token_ids == outs[1].token_ids


def test_eos_stops_generation(tiny_ckpt, hf_greedy):
    # Declare the 4th greedy token of prompt 0 an EOS: generation stops right there.
    prompt, want = _prompts()[0], hf_greedy[0]
    eos = want[3]
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[eos])
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    cut = want.index(eos) + 1
    assert out.token_ids == want[:cut]
    assert out.finish_reason == "stop"


def test_chat_applies_template(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        msgs = [{"role": "user", "content": "Hello"}]
        out = llm.chat(msgs, max_new_tokens=4, use_tqdm=False)[0]
        templated = llm.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=False
        )
        assert out.prompt == templated
        direct = llm.generate([out.prompt_token_ids], max_new_tokens=4, use_tqdm=False)[0]
        assert out.token_ids == direct.token_ids


def test_chat_takes_openai_content_parts(tiny_ckpt):
    """Content as OpenAI's list of text parts is the same prompt as the joined string (before,
    the part list itself was templated, as its Python repr); other parts are refused, naming
    the conversation and the part."""
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        plain = [{"role": "user", "content": "Hello there"}]
        parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                              {"type": "text", "text": " there"}]}]  # fmt: skip
        a, b = llm.chat([plain, parts], max_new_tokens=3, use_tqdm=False)
        assert a.prompt == b.prompt and "type" not in b.prompt and a.token_ids == b.token_ids
        image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
        bad = [{"role": "user", "content": [{"type": "text", "text": "what is"}, image]}]
        with pytest.raises(ValueError, match="conversation 1: 'image_url' content parts"):
            llm.chat([plain, bad], max_new_tokens=3, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()


def test_chat_continue_final_message_and_template_kwargs(tiny_ckpt, monkeypatch):
    """vLLM's chat options: the last assistant message left open for the model to continue,
    and extra template variables."""
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Sure, "}]
        (out,) = llm.chat(msgs, max_new_tokens=3, use_tqdm=False, add_generation_prompt=False,
                          continue_final_message=True)  # fmt: skip
        assert out.prompt.endswith("Sure, ")
        with pytest.raises(ValueError, match="continue_final_message needs"):
            llm.chat(msgs, continue_final_message=True)
        template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
        monkeypatch.setattr(llm.tokenizer, "chat_template", template)
        (out,) = llm.chat(msgs[:1], max_new_tokens=2, use_tqdm=False,
                          chat_template_kwargs={"greeting": "Ahoy"})  # fmt: skip
        assert out.prompt == "Ahoy Hello\n"
        names = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
        monkeypatch.setattr(llm.tokenizer, "chat_template", names + "{{ messages[0]['content'] }}")
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        (out,) = llm.chat(msgs[:1], max_new_tokens=2, use_tqdm=False, tools=[tool])
        assert out.prompt == "get_weather;Hello"


BAD_INPUTS = [
    ([[5, 6], []], {}, r"prompt 1: the prompt is empty"),
    ([[5] * 600], {}, r"prompt 0: the prompt has 600 tokens.*max_model_len=512"),
    ([[5, 6]], {"max_new_tokens": 0}, r"max_new_tokens must be at least 1, got 0"),
    ([[5] * 500], {"max_new_tokens": 20}, r"prompt 0: 500 prompt tokens \+ max_tokens=20 = 520"),
    ([[5, 999]], {}, r"prompt 0: token ids must be integers in \[0, 320\); got \[999\]"),
    ([[5, 6.5]], {}, r"prompt 0: token ids must be integers in \[0, 320\); got \[6.5\]"),
]


@pytest.mark.parametrize("prompts,kw,match", BAD_INPUTS)
def test_bad_input_then_still_usable(tiny_ckpt, prompts, kw, match):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, use_tqdm=False, **kw)
        stats = llm.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert stats["num_unfinished_requests"] == 0
        out = llm.generate([[5, 6, 7]], max_new_tokens=3, use_tqdm=False)
        assert len(out[0].token_ids) == 3


def test_kv_cache_too_small_fails_at_start(tiny_ckpt):
    with pytest.raises(ValueError, match=r"KV cache too small.*max_model_len=512.*needs 32 blocks"):
        LLM(str(tiny_ckpt), device="cpu", kv_cache_memory_bytes=10 * 8192, max_model_len=512)


def test_default_max_model_len_is_capped_to_the_cache(tiny_ckpt, capsys):
    """Without max_model_len, a small cache lowers the model's 512 positions (and says so)."""
    with LLM(str(tiny_ckpt), device="cpu", kv_cache_memory_bytes=10 * 8192) as llm:
        assert llm.config.scheduler.max_model_len == 10 * 16
        assert "max_model_len lowered from 512 to 160" in capsys.readouterr().out
        with pytest.raises(ValueError, match="max_model_len=160"):
            llm.generate([[5] * 150], max_new_tokens=20, use_tqdm=False)
        assert len(llm.generate([[5] * 150], max_new_tokens=10, use_tqdm=False)[0].token_ids) == 10


def test_interrupted_generate_leaves_no_blocks(tiny_ckpt, monkeypatch):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        calls = {"n": 0}
        step = llm.engine.step

        def failing_step():
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return step()

        monkeypatch.setattr(llm.engine, "step", failing_step)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(_prompts(), max_new_tokens=8, use_tqdm=False)
        monkeypatch.undo()
        stats = llm.stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert not llm.engine.has_unfinished_requests()
        assert len(llm.generate([[5, 6]], max_new_tokens=2, use_tqdm=False)[0].token_ids) == 2


def test_startup_heap_frozen_while_open(tiny_ckpt):
    """Full GC collections during generate would walk torch's and the model's objects: the LLM
    freezes the heap it starts with and thaws it on close, so its objects can be collected
    again afterwards."""
    import gc

    llm = LLM(str(tiny_ckpt), device="cpu")
    try:
        assert gc.get_freeze_count() > 10_000
        llm.generate([[1, 2, 3]], max_new_tokens=2, use_tqdm=False)
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0
    llm = LLM(str(tiny_ckpt), device="cpu")
    assert gc.get_freeze_count() > 10_000
    del llm  # never closed: collected, the heap is thawed all the same
    gc.collect()
    # CPython 3.12.3 (the GPU machine's) reports a few hundred (375) after the collection
    # with no gc.freeze() call in between (seen with gc.freeze wrapped); 3.11 reports 0. The
    # ~10^5 objects of the frozen heap are what must be gone.
    assert gc.get_freeze_count() < 1_000
