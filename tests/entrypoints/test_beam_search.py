"""LLM.beam_search (vLLM's): the same beams as a beam search written here over transformers'
log-probabilities (the oracle, float64 scores), with and without an EOS that completes beams;
width 1 is greedy decoding; prompts as text, ids and dicts; the parameters' checks."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import hf_model, make_sharp_checkpoint

from llm_inference import LLM, BeamSearchParams, SamplingParams

PROMPTS = [[5, 17, 42, 99], [7, 8]]


def reference(model, prompt, width, steps, eos=(), length_penalty=1.0):
    """Beam search as vLLM's: 2 x width candidates per beam, EOS completes a beam, the best
    `width` of live and complete by cum_logprob / length ** length_penalty."""

    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] in eos)) ** length_penalty

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            top = torch.topk(torch.log_softmax(logits, -1), 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t in eos else candidates).append((tokens + [t], cum + lp))
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    return make_sharp_checkpoint(tmp_path_factory.mktemp("beam"), hidden_size=128,
                                 intermediate_size=256, num_hidden_layers=2)  # fmt: skip


def _same(got, want):
    assert [s.tokens for s in got.sequences] == [t for t, _ in want]
    for s, (_, cum) in zip(got.sequences, want):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-3)


def test_beams_equal_the_oracles(sharp):
    model = hf_model(sharp)
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True, length_penalty=0.7)
    with LLM(str(sharp), device="cpu") as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        text = llm.tokenizer.decode(PROMPTS[0])
        (from_text,) = llm.beam_search(text, params)
    for out, prompt in zip(outs, PROMPTS):
        want = reference(model, prompt, 3, 4, length_penalty=0.7)
        _same(out, want)
        best = out.sequences[0]
        assert len(best.logprobs) == 4 and all(len(lp) == 6 for lp in best.logprobs)
        assert best.finish_reason == "length"
        assert best.text == llm.tokenizer.decode(best.tokens)
    ids = llm.tokenizer(text).input_ids
    _same(from_text, reference(model, ids, 3, 4, length_penalty=0.7))


def test_eos_completes_a_beam(sharp, tmp_path):
    """The model's EOS is made the second candidate of the first step: that beam completes
    there (shorter, finish_reason "stop") and competes at the end with the live ones, where the
    length penalty decides: without it (0) the short beam's higher log-probability wins, with a
    strong one (8) the full-length beams do."""
    model = hf_model(sharp)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    eos = int(torch.topk(logits, 2).indices[1])
    folder = tmp_path / "eos"
    folder.mkdir()
    for f in sharp.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    best = {}
    with LLM(str(folder), device="cpu") as llm:
        for penalty in (0.0, 1.0, 8.0):  # 1.0, the default: a final EOS not in the length
            params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty)
            (out,) = llm.beam_search([PROMPTS[0]], params)
            _same(out, reference(model, PROMPTS[0], 2, 3, eos=(eos,), length_penalty=penalty))
            for s in out.sequences:
                assert s.finish_reason == ("stop" if s.tokens[-1] == eos else "length")
            best[penalty] = out.sequences[0]
    assert best[0.0].tokens == PROMPTS[0] + [eos] and best[0.0].finish_reason == "stop"
    assert len(best[8.0].tokens) == len(PROMPTS[0]) + 3


def test_width_one_is_greedy(sharp):
    with LLM(str(sharp), device="cpu") as llm:
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6,
                                                         ignore_eos=True))  # fmt: skip
        greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                      ignore_eos=True), use_tqdm=False)  # fmt: skip
        assert llm.stats()["num_unfinished_requests"] == 0
    for out, g, p in zip(outs, greedy, PROMPTS):
        (seq,) = out.sequences
        assert seq.tokens == p + g.token_ids


def test_checks(sharp):
    for kw, match in (({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                      ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                      ({"length_penalty": float("nan")}, "length_penalty")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 2, **kw})
    with LLM(str(sharp), device="cpu", max_model_len=64) as llm:
        with pytest.raises(TypeError, match="BeamSearchParams"):
            llm.beam_search(PROMPTS, SamplingParams())
        with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
            llm.beam_search([[5], []], BeamSearchParams(beam_width=2, max_tokens=2))
        # beams that fill the context stop there
        (out,) = llm.beam_search([[5] * 60], BeamSearchParams(2, 10, ignore_eos=True))
        assert all(len(s.tokens) == 64 and s.finish_reason == "length" for s in out.sequences)
