"""SamplingParams: every invalid value raises a ValueError naming its field and range; a
validated object is frozen (changes make new validated objects) and knows its sampling path."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from llm_inference.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    SamplingPath,
    StructuredOutputsParams,
)

INVALID = [
    ("n", 0, "n must be an integer >= 1"),
    ("n", 1.5, "n must be an integer >= 1"),
    ("temperature", -0.1, "temperature must be finite and >= 0"),
    ("temperature", float("nan"), "temperature must be finite and >= 0"),
    ("temperature", float("inf"), "temperature must be finite and >= 0"),
    ("temperature", "hot", "temperature must be a number"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.01, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be -1 or 0 (disabled) or an integer >= 1"),
    ("top_k", 2.5, "top_k must be -1 or 0 (disabled) or an integer >= 1"),
    ("min_p", -0.01, "min_p must be in [0, 1]"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("presence_penalty", -2.01, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2]"),
    ("frequency_penalty", 2.01, "frequency_penalty must be in [-2, 2]"),
    ("max_tokens", 0, "max_tokens must be None or an integer >= 1"),
    ("max_tokens", -5, "max_tokens must be None or an integer >= 1"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("logprobs", -1, "logprobs must be None or an integer in [0, 20]"),
    ("logprobs", 21, "logprobs must be None or an integer in [0, 20]"),
    ("stop_token_ids", [1, "2"], "stop_token_ids must be a list of non-negative integers"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of non-negative integers"),
    ("seed", 1.5, "seed must be None or an integer"),
    ("seed", "42", "seed must be None or an integer"),
    ("stop", "", "stop must be a non-empty string or a list of non-empty strings"),
    ("stop", ["ok", 3], "stop must be a non-empty string or a list of non-empty strings"),
    ("logit_bias", {5: 100.5}, "logit_bias must be None or a dict of non-negative token ids"),
    ("logit_bias", {-1: 1.0}, "logit_bias must be None or a dict of non-negative token ids"),
    ("logit_bias", {"5": 1.0}, "logit_bias must be None or a dict of non-negative token ids"),
    ("logit_bias", {5: float("nan")}, "to numbers in [-100, 100]"),
    ("logit_bias", [5], "logit_bias must be None or a dict"),
    ("allowed_token_ids", [], "allowed_token_ids must be None or a non-empty list"),
    ("allowed_token_ids", [3, -1], "allowed_token_ids must be None or a non-empty list"),
    ("allowed_token_ids", 7, "allowed_token_ids must be None or a non-empty list"),
    ("truncate_prompt_tokens", 0, "truncate_prompt_tokens must be None, -1"),
    ("truncate_prompt_tokens", -2, "truncate_prompt_tokens must be None, -1"),
    ("truncate_prompt_tokens", 2.0, "truncate_prompt_tokens must be None, -1"),
]


@pytest.mark.parametrize("field,value,message", INVALID)
def test_invalid_values_raise_naming_field_and_range(field, value, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert message in str(err.value)
    assert repr(value) in str(err.value)  # the offending value is shown too


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=1000)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0),
        dict(top_p=1.0),
        dict(top_p=1e-3),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=0.5),
        dict(max_tokens=None),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(seed=-7),
        dict(seed=2**80),
        dict(stop_token_ids=[0, 5]),
        dict(stop=["a", "bc"]),
    ],
)
def test_boundary_values_are_accepted(kw):
    params = SamplingParams(**kw)
    for key, value in kw.items():
        assert getattr(params, key) == (tuple(value) if isinstance(value, list) else value)


def test_stop_strings_and_defaults():
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["x", "yz"]).stop_strings == ("x", "yz")
    assert SamplingParams().stop_strings == ()
    assert (
        SamplingParams().stop_token_ids == () == SamplingParams(stop_token_ids=None).stop_token_ids
    )


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below 1e-5 counts as greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy


def test_replace_makes_a_validated_copy():
    params = SamplingParams(stop=["a"], stop_token_ids=[3], seed=1, temperature=0.5)
    other = params.replace(seed=2)
    assert other.seed == 2 and other.temperature == 0.5 and other.stop_strings == ("a",)
    assert params.seed == 1
    assert params.replace() == params and params.replace() is not params
    assert dataclasses.replace(params, logprobs=1).sampling_path is SamplingPath.SYNC
    with pytest.raises(ValueError, match="top_p"):
        params.replace(top_p=2.0)


def test_given_containers_are_copied_and_lists_become_tuples():
    bias, allowed, stop_ids, words = {5: 2.0}, [1, 2], [7], ["no"]
    p = SamplingParams(logit_bias=bias, allowed_token_ids=allowed, stop_token_ids=stop_ids,
                       bad_words=words)  # fmt: skip
    bias[6], allowed[0], stop_ids[0], words[0] = 1.0, 9, 8, "yes"  # the caller's objects change
    assert p.logit_bias == {5: 2.0} and p.logit_bias is not bias  # the params do not
    assert (p.allowed_token_ids, p.stop_token_ids, p.bad_words) == ((1, 2), (7,), ("no",))
    assert SamplingParams(logit_bias={}).logit_bias is None  # an empty dict is no bias
    assert SamplingParams(bad_words=[]).bad_words is None
    choice = ["yes", "no"]
    so = StructuredOutputsParams(choice=choice)
    choice[0] = "maybe"
    assert so.choice == ("yes", "no")
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}}
    so = StructuredOutputsParams(json=schema)
    schema["properties"]["a"]["enum"].append(3)
    assert so.json == {"type": "object", "properties": {"a": {"enum": [1, 2]}}}


def test_validated_params_are_frozen():
    p = SamplingParams(temperature=0.5, stop="x", bad_words=["w"])
    for name in [f.name for f in dataclasses.fields(p)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p, name, getattr(p, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        StructuredOutputsParams(choice=["a"]).choice = ("b",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        BeamSearchParams(beam_width=2, max_tokens=4).beam_width = 3
    with pytest.raises(AttributeError):
        p.stop_token_ids.append(3)  # a tuple: nothing to change inside either
    # plain data for the workers: a pickled copy is equal and knows its path
    q = SamplingParams(logprobs=2, structured_outputs=StructuredOutputsParams(choice=["a"]))
    back = pickle.loads(pickle.dumps(q))
    assert back == q and back.sampling_path is SamplingPath.SYNC


STAGED_KINDS = [
    dict(),
    # a grammar is no sampling path: its mask reaches the sampler on any (sample/grammar.py)
    dict(structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=3),
    dict(n=3, max_tokens=5, stop=["."], stop_token_ids=[2], ignore_eos=True, prompt_logprobs=1),
    dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0),
]
HOST_KINDS = [
    dict(min_tokens=1),
    dict(logit_bias={3: 2.0}),
    dict(allowed_token_ids=[3, 4]),
    dict(temperature=0.0, min_tokens=2, logit_bias={1: -1.0}),
]
SYNC_KINDS = [
    dict(repetition_penalty=1.1),
    dict(presence_penalty=0.5),
    dict(frequency_penalty=-0.5),
    dict(logprobs=0),
    dict(bad_words=["w"]),
    dict(min_tokens=1, logprobs=3),  # the most demanding kind decides
    dict(allowed_token_ids=[1], repetition_penalty=0.9),
]


@pytest.mark.parametrize(
    "kw,path",
    [(kw, SamplingPath.STAGED) for kw in STAGED_KINDS]
    + [(kw, SamplingPath.HOST) for kw in HOST_KINDS]
    + [(kw, SamplingPath.SYNC) for kw in SYNC_KINDS],
)
def test_sampling_path_of_each_kind_of_parameter(kw, path):
    p = SamplingParams(**kw)
    assert p.sampling_path is path
    assert p.replace(seed=11).sampling_path is path  # recomputed with every copy


def test_with_token_ids_makes_a_new_object():
    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    p = SamplingParams(bad_words=["ab"], min_tokens=1)
    q = p.with_token_ids(Tokenizer())
    assert q is not p and p.bad_words_token_ids == ()
    assert q.bad_words_token_ids == ((97, 98),)  # " ab" is longer: no second sequence
    assert q.replace(n=2, seed=5).bad_words_token_ids == q.bad_words_token_ids  # children too
    plain = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["xy", "z"]))
    assert plain.with_token_ids(Tokenizer()) is plain


def test_structured_outputs_params_checked():
    """Exactly one kind of spec, each of its type (the grammar itself is checked when the
    request is added: tests/structured_output); and nothing that could keep an answer from
    ending where its grammar ends."""
    for kw in ({}, {"json": {}, "regex": "a+"}, {"choice": ["a"], "grammar": "root ::= x"},
               {"json_object": False}):  # fmt: skip
        with pytest.raises(ValueError, match="structured_outputs must set exactly one of"):
            StructuredOutputsParams(**kw)
    for kw, name in (({"choice": "ab"}, "choice"), ({"choice": [""]}, "choice"),
                     ({"choice": []}, "choice"), ({"json": 3}, "json"), ({"regex": ""}, "regex"),
                     ({"grammar": 1}, "grammar"), ({"json_object": 1}, "json_object"),
                     ({"json": {"x": {1, 2}}}, "json"),
                     ({"structural_tag": "[1]"}, "structural_tag"),
                     ({"structural_tag": "{oops"}, "structural_tag")):  # fmt: skip
        with pytest.raises(ValueError, match=f"structured_outputs.{name} (must|is not)"):
            StructuredOutputsParams(**kw)
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json='{"type": "integer"}').kind == "json"
    tag = StructuredOutputsParams(structural_tag={"type": "structural_tag"})
    assert tag.kind == "structural_tag" and tag.structural_tag == '{"type": "structural_tag"}'
    so = StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="allowed_token_ids must be None with structured"):
        SamplingParams(structured_outputs=so, allowed_token_ids=[1])
    with pytest.raises(ValueError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(structured_outputs=so, min_tokens=1)
    with pytest.raises(ValueError, match="ignore_eos must be False with structured_outputs"):
        SamplingParams(structured_outputs=so, ignore_eos=True)
    assert SamplingParams(structured_outputs=so, ignore_eos=True, stop_token_ids=[5])
    with pytest.raises(ValueError, match="structured_outputs must be None or a Structured"):
        SamplingParams(structured_outputs={"choice": ["a"]})
