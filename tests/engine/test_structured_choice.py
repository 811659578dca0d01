"""Structured outputs with `choice` (vLLM's StructuredOutputsParams): every output, greedy or
sampled, one prompt or many, is exactly one of the choices and ends with EOS; the other kinds
are refused; the rest of the batch is untouched."""

from __future__ import annotations

import pytest

from llm_inference import LLM, SamplingParams, StructuredOutputsParams

CHOICES = ["yes please", "no", "maybe later", "no way"]
PROMPTS = ["The quick brown", "Paris is the capital", "Hello world! How are"]


def test_outputs_are_one_of_the_choices(tiny_ckpt):
    so = StructuredOutputsParams(choice=CHOICES)
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        base = llm.generate(PROMPTS, plain, use_tqdm=False)
        params = [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=so,
                                 n=4),
                  plain]  # fmt: skip
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        texts = [c.text for o in outs[:2] for c in o.outputs]
        assert len(texts) == 5 and set(texts) <= set(CHOICES)
        assert all(c.finish_reason == "stop" for o in outs[:2] for c in o.outputs)
        assert outs[2].token_ids == base[2].token_ids
        # the choices are not what the model says unconstrained
        assert base[0].text not in CHOICES


def test_structured_outputs_validated():
    for kw in ({"json": {"type": "object"}}, {"regex": "a+"}, {"grammar": "x"},
               {"json_object": True}):  # fmt: skip
        with pytest.raises(ValueError, match=f"structured_outputs.{next(iter(kw))} is not"):
            StructuredOutputsParams(choice=["a"], **kw)
    for bad in (None, [], [""], "ab"):
        with pytest.raises(ValueError, match="structured_outputs.choice must be"):
            StructuredOutputsParams(choice=bad)
    so = StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="allowed_token_ids must be None with structured"):
        SamplingParams(structured_outputs=so, allowed_token_ids=[1])
    with pytest.raises(ValueError, match="structured_outputs must be None or a Structured"):
        SamplingParams(structured_outputs={"choice": ["a"]})


def test_choice_shorter_than_min_tokens_refused(tiny_ckpt):
    """min_tokens beyond a choice's length would leave that choice no way to end (its EOS
    masked, nothing else allowed): refused when the request is added, naming the choice; the
    engine keeps serving (a fitting min_tokens gives one of the choices)."""
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        tok = llm.get_tokenizer()
        lengths = {c: len(tok.encode(c, add_special_tokens=False)) for c in CHOICES}
        shortest = min(CHOICES, key=lengths.get)
        so = StructuredOutputsParams(choice=CHOICES)
        too_many = SamplingParams(max_tokens=20, min_tokens=lengths[shortest] + 1,
                                  structured_outputs=so)  # fmt: skip
        named = f"min_tokens=.* exceeds .*choice {shortest!r}: that choice could never"
        with pytest.raises(ValueError, match=named):
            llm.generate(PROMPTS[:1], too_many, use_tqdm=False)
        fits = SamplingParams(max_tokens=20, min_tokens=lengths[shortest], structured_outputs=so)
        (out,) = llm.generate(PROMPTS[:1], fits, use_tqdm=False)
        assert out.outputs[0].text in CHOICES
        assert not llm.engine.has_unfinished_requests()
