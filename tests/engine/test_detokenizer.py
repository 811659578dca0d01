"""IncrementalDetokenizer with the tiny byte-level BPE tokenizer of tests/helpers.py."""

from __future__ import annotations

import pytest
from helpers import _tokenizer_template

from llm_inference.engine.detokenizer import IncrementalDetokenizer
from llm_inference.sampling_params import SamplingParams

TOK = _tokenizer_template()
UNICODE = "Unicode: café, naïve, 日本語, emoji 🙂."
FOX = "The quick brown fox jumps over the lazy dog."


def encode(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def run(text_or_ids, chunk=1, prompt=(), **params):
    """Feed tokens `chunk` at a time; return (detokenizer, deltas, stop results per call)."""
    ids = encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    detok = IncrementalDetokenizer(TOK, list(prompt), SamplingParams(**params))
    deltas, stops = [], []
    for i in range(0, len(ids), chunk):
        stops.append(detok.add_tokens(ids[i : i + chunk]))
        deltas.append(detok.get_delta())
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stops


def test_multibyte_characters_split_across_tokens():
    ids = encode(UNICODE)
    pieces = [TOK.decode([i]) for i in ids]
    assert sum("\ufffd" in p for p in pieces) >= 6  # precondition: characters are split
    for chunk in (1, 2, 3, len(ids)):
        detok, deltas, stops = run(UNICODE, chunk=chunk)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == detok.output_text == UNICODE
        assert detok.token_ids == ids and set(stops) == {None}


def test_text_never_holds_a_partial_character():
    ids = encode("日本語🙂")
    detok = IncrementalDetokenizer(TOK, [], SamplingParams())
    for i in ids:
        detok.add_tokens([i])
        assert "\ufffd" not in detok.output_text
        assert "日本語🙂".startswith(detok.output_text)
    assert detok.output_text == "日本語🙂"


def test_prompt_context_does_not_leak_into_output():
    prompt = encode("Hello world! How are")
    detok, deltas, _ = run(" you today? café", prompt=prompt)
    assert detok.output_text == "".join(deltas) == " you today? café"


@pytest.mark.parametrize(
    "stop,include,expected",
    [
        ("ck bro", False, "The qui"),  # spans 'ic', 'k', ' ', 'br'
        ("ck bro", True, "The quick bro"),
        ("quick brown fox", False, "The "),  # spans many tokens
        ("lazy dog.", True, FOX),  # ends exactly with the last token
        ("u", False, "The q"),  # inside one token, mid-text
    ],
)
def test_stop_string_across_tokens(stop, include, expected):
    ids = encode(FOX)
    detok, deltas, stops = run(ids, stop=stop, include_stop_str_in_output=include)
    assert detok.output_text == expected
    assert "".join(deltas) == expected  # streaming never emitted text beyond the cut
    first = stops.index(stop)
    assert stops[:first] == [None] * first
    # the stop was found at the token that completed it, not later
    assert stop in TOK.decode(ids[: first + 1]) and stop not in TOK.decode(ids[:first])


def test_stop_string_spans_tokens_precondition():
    pieces = [TOK.decode([i]) for i in encode(FOX)]
    assert not any("ck bro" in p for p in pieces)
    assert not any("quick brown fox" in p for p in pieces)


def test_stop_string_of_split_multibyte_characters():
    detok, deltas, stops = run("日本語🙂 end", stop="本語")
    assert detok.output_text == "".join(deltas) == "日"
    assert "本語" in stops


def test_earliest_stop_wins_and_later_tokens_are_ignored():
    ids = encode(FOX)
    detok = IncrementalDetokenizer(TOK, [], SamplingParams(stop=["fox", "quick"]))
    assert detok.add_tokens(ids) == "quick"
    assert detok.output_text == "The "
    assert detok.add_tokens(encode(" more")) == "quick"
    assert detok.output_text == "The " and detok.token_ids == ids[: len(detok.token_ids)]
    # "brown" and "own" both complete with the token "n": the one starting first wins
    detok = IncrementalDetokenizer(TOK, [], SamplingParams(stop=["own", "brown"]))
    assert detok.add_tokens(ids) == "brown"
    assert detok.output_text == "The quick "


def test_delta_holds_back_possible_stop_prefix():
    ids = encode(FOX)
    detok = IncrementalDetokenizer(TOK, [], SamplingParams(stop="brown cow"))
    sent = ""
    for i in ids:
        detok.add_tokens([i])
        sent += detok.get_delta()
        text = detok.output_text
        assert text.startswith(sent)
        held = text[len(sent) :]
        # what is held back is exactly the tail that could still start "brown cow"
        assert "brown cow".startswith(held) and len(held) < len("brown cow")
        if text.endswith(" br"):
            assert held == "br"
    assert sent == FOX  # "brown " was released once "f" ruled the stop out
    assert detok.get_delta(finished=True) == ""


def test_finished_releases_held_text():
    detok = IncrementalDetokenizer(TOK, [], SamplingParams(stop="dog!"))
    detok.add_tokens(encode("lazy do"))
    assert detok.get_delta() == "lazy "
    assert detok.get_delta(finished=True) == "do"


@pytest.mark.parametrize("skip,expected", [(True, "hi there"), (False, "hi<|eos|> there")])
def test_skip_special_tokens(skip, expected):
    ids = encode("hi") + [TOK.eos_token_id] + encode(" there")
    detok, deltas, _ = run(ids, skip_special_tokens=skip)
    assert detok.output_text == "".join(deltas) == expected


def test_stop_strings_wait_for_min_tokens():
    text = "The fox. The dog."
    ids = encode(text)
    first_the = next(n for n in range(1, len(ids)) if "The" in TOK.decode(ids[:n]))
    detok, _, _ = run(ids, stop="The", min_tokens=first_the, max_tokens=len(ids))
    assert detok.output_text == "The fox. "  # the first "The" came before min_tokens
    detok, _, _ = run(ids, stop="The")
    assert detok.output_text == ""


def final_text(ids, prompt, deferred, **params):
    detok = IncrementalDetokenizer(TOK, list(prompt), SamplingParams(**params), deferred=deferred)
    for i in range(0, len(ids), 3):
        detok.add_tokens(ids[i : i + 3])
        if deferred:
            assert detok.get_delta() == ""  # nothing before the end
    return detok.get_delta(finished=True), detok


@pytest.mark.parametrize("skip", [True, False])
def test_deferred_text_equals_token_by_token(skip):
    """An offline completion's text, made once at the end, is the streamed text: on random
    token sequences (dangling and split UTF-8 bytes, special tokens) and on real text."""
    import random

    rng = random.Random(0)
    vocab = TOK.vocab_size + len(TOK.added_tokens_encoder)
    cases = [(encode(UNICODE), encode("Hello")), (encode(FOX + UNICODE), [])]
    cases += [
        ([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))],
         [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))])
        for _ in range(300)
    ]  # fmt: skip
    fell_back = 0
    for ids, prompt in cases:
        want, _ = final_text(ids, prompt, False, skip_special_tokens=skip)
        got, detok = final_text(ids, prompt, True, skip_special_tokens=skip)
        assert got == want, (ids, prompt)
        assert detok.token_ids == ids and detok.output_text == want
        fell_back += detok._stream is not None
    assert 0 < fell_back < len(cases)  # both ways were taken


def test_deferred_is_off_with_stop_strings():
    detok, deltas, stops = run(FOX, stop=["lazy"])
    deferred = IncrementalDetokenizer(TOK, [], SamplingParams(stop=["lazy"]), deferred=True)
    assert not deferred.deferred
    assert deferred.add_tokens(encode(FOX)) == "lazy"
    assert (
        deferred.get_delta(finished=True)
        == "".join(deltas)
        == "The quick brown fox jumps over the "
    )
