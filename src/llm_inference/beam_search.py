"""Beam search over the engine, as vLLM's `LLM.beam_search` does it.

Each round asks the engine for one token of every live beam (a prompt of the beam's tokens,
`max_tokens=1`) with the 2 x beam_width most likely next tokens and their log-probabilities
(`logprobs`, from the raw logits), extends every beam by each of them, and keeps the
beam_width best of each prompt's candidates. A candidate that ends in EOS (the model's EOS
ids, unless `ignore_eos`) is complete and leaves the round; so is a beam that fills the
context. At the end the complete and live beams are ranked together. A beam's score is its
cumulative log-probability / its length ** length_penalty, the length counting the prompt and
not a final EOS (vLLM's `get_beam_search_score`).

Rounds re-send each beam's tokens: prefix caching (on by default) finds their full blocks
cached, so a round computes about a block's worth of tokens per beam, not the whole beam.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_inference.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (prompt and generated), per generated token the candidates' log-
    probabilities ({token id: logprob}), the cumulative log-probability of the generated
    tokens, and, once returned, `text` (the tokens decoded, prompt included, as vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """A prompt's beam_width best sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_ids, length_penalty: float):
    """vLLM's score: cum_logprob / length ** length_penalty, a final EOS not counted."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cum_logprob / (length**length_penalty)


def beam_search(
    llm, prompt_ids: list[list[int]], params: BeamSearchParams, use_tqdm: bool = False
) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids) on an open `LLM`."""
    from tqdm.auto import tqdm

    eos = () if params.ignore_eos else tuple(llm.config.model.eos_token_ids)
    max_len = llm.config.scheduler.max_model_len
    width = params.beam_width

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    live = [[BeamSearchSequence(list(ids))] for ids in prompt_ids]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
    step = SamplingParams(temperature=params.temperature, max_tokens=1, ignore_eos=True,
                          logprobs=2 * width, detokenize=False)  # fmt: skip
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        for i, beams in enumerate(live):  # a beam that fills the context is complete
            full = [b for b in beams if len(b.tokens) >= max_len]
            for b in full:
                b.finish_reason = "length"
            done[i] += full
            live[i] = [b for b in beams if len(b.tokens) < max_len]
        batch = [b for beams in live for b in beams]
        if not batch:
            break
        outs = iter(llm.generate([b.tokens for b in batch], step, use_tqdm=False))
        for i, beams in enumerate(live):
            candidates = []
            for beam in beams:
                top = next(outs).outputs[0].logprobs[0].top
                for token, logprob in top.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                             beam.cum_logprob + logprob)  # fmt: skip
                    if token in eos:
                        new.finish_reason = "stop"
                        done[i].append(new)
                    else:
                        candidates.append(new)
            live[i] = sorted(candidates, key=score, reverse=True)[:width]
    results = []
    for beams, complete in zip(live, done):
        for b in beams:
            b.finish_reason = b.finish_reason or "length"
        best = sorted(complete + beams, key=score, reverse=True)[:width]
        for b in best:
            b.text = llm.tokenizer.decode(b.tokens)
        results.append(BeamSearchOutput(best))
    return results
