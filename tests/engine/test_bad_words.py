"""SamplingParams.bad_words on the CPU engine: a word found in a greedy output (one token, and
two) never appears in the output once banned, the rest of the batch is untouched; the words'
token sequences as vLLM forms them (alone and after a space); validation."""

from __future__ import annotations

import pytest

from llm_inference import LLM, SamplingParams

PROMPTS = ["The quick brown", "Paris is the capital", "Hello world! How are"]


def contains(seq: list[int], part: tuple[int, ...]) -> bool:
    n = len(part)
    return any(tuple(seq[i : i + n]) == part for i in range(len(seq) - n + 1))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)


def clean_words(tok, tokens: list[int], size: int) -> list[str]:
    """Words of `size` consecutive output tokens that tokenize back to exactly those tokens."""
    found = []
    for i in range(len(tokens) - size + 1):
        word = tok.decode(tokens[i : i + size])
        if word.strip().isalpha() and tok.encode(word, add_special_tokens=False) == list(
            tokens[i : i + size]
        ):
            found.append(word)
    return found


@pytest.mark.parametrize("size", [1, 2], ids=["one_token", "two_tokens"])
def test_banned_word_never_appears(tiny_ckpt, size):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        tok = llm.get_tokenizer()
        base = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        words = [w for o in base[:1] for w in clean_words(tok, o.token_ids, size)]
        assert words, "no clean word in the greedy output to ban"
        banned = greedy(bad_words=[words[0]]).with_token_ids(tok)
        assert any(contains(base[0].token_ids, s) for s in banned.bad_words_token_ids)
        outs = llm.generate(PROMPTS, [banned, greedy(), greedy()], use_tqdm=False)
        assert not any(contains(outs[0].token_ids, s) for s in banned.bad_words_token_ids)
        assert outs[0].token_ids != base[0].token_ids
        assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in base[1:]]


def test_bad_words_token_sequences(tiny_ckpt):
    from llm_inference.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    p = SamplingParams(bad_words=["fox", " quick brown"]).with_token_ids(tok)
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False))  # noqa: E731
    want = [enc("fox")]
    if enc(" fox")[0] != enc("fox")[0] and len(enc(" fox")) == len(enc("fox")):
        want.append(enc(" fox"))
    want.append(enc("quick brown"))
    if enc(" quick brown")[0] != enc("quick brown")[0] and len(enc(" quick brown")) == len(
        enc("quick brown")
    ):
        want.append(enc(" quick brown"))
    assert list(p.bad_words_token_ids) == want
    assert SamplingParams(bad_words=[]).bad_words is None


@pytest.mark.parametrize("bad", [[""], ["  "], "fox", [3]])
def test_bad_words_validated(bad):
    with pytest.raises(ValueError, match="bad_words must be None or a list of non-empty"):
        SamplingParams(bad_words=bad)


def test_allowed_tokens_all_banned_refused(tiny_ckpt):
    """allowed_token_ids whose every token is a one-token bad word leave nothing to sample:
    refused when the request is added (before, the sampler warned and took the argmax of the
    masked row); one allowed token left unbanned is fine."""
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        tok = llm.get_tokenizer()
        one = [
            w
            for w in ("the", "a", "is", "of", "and")
            if len(tok.encode(w, add_special_tokens=False)) == 1
        ]
        assert len(one) >= 2, "need two one-token words"
        ids = [tok.encode(w, add_special_tokens=False)[0] for w in one[:2]]
        both = greedy(allowed_token_ids=ids, bad_words=one[:2])
        with pytest.raises(ValueError, match="every token of allowed_token_ids .* is a bad word"):
            llm.generate(PROMPTS[:1], both, use_tqdm=False)
        (out,) = llm.generate(PROMPTS[:1], greedy(allowed_token_ids=ids, bad_words=one[:1]),
                              use_tqdm=False)  # fmt: skip
        assert set(out.token_ids) == {ids[1]}
        assert not llm.engine.has_unfinished_requests()
