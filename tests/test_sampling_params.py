"""SamplingParams: every invalid value raises a ValueError naming its field and range."""

from __future__ import annotations

import pytest

from llm_inference.sampling_params import SamplingParams

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
        assert getattr(params, key) == value


def test_stop_strings_and_defaults():
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["x", "yz"]).stop_strings == ("x", "yz")
    assert SamplingParams().stop_strings == ()
    assert SamplingParams().stop_token_ids == []


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below 1e-5 counts as greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().greedy


def test_replace_and_clone_are_validated_copies():
    params = SamplingParams(stop=["a"], stop_token_ids=[3], seed=1, temperature=0.5)
    other = params.replace(seed=2)
    assert other.seed == 2 and other.temperature == 0.5 and other.stop_strings == ("a",)
    assert params.seed == 1
    twin = params.clone()
    assert twin == params and twin is not params
    twin.stop_token_ids.append(9)
    assert params.stop_token_ids == [3]  # lists are not shared
    with pytest.raises(ValueError, match="top_p"):
        params.replace(top_p=2.0)


def test_logit_bias_and_allowed_token_ids_are_copied():
    bias, allowed = {5: 2.0}, [1, 2]
    p = SamplingParams(logit_bias=bias, allowed_token_ids=allowed)
    bias[6], allowed[0] = 1.0, 9  # the caller's objects change; the params do not
    q = p.replace()
    q.logit_bias[7], q.allowed_token_ids[1] = 3.0, 8
    assert p.logit_bias == {5: 2.0} and p.allowed_token_ids == [1, 2]
    assert p.has_logit_bias and not SamplingParams().has_logit_bias
    assert SamplingParams(logit_bias={}).logit_bias is None  # an empty dict is no bias
