"""Beam search over the engine, as vLLM's `LLM.beam_search` (and its server's
`use_beam_search`) does it.

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
`BeamSearch` holds the beams; `beam_search` drives it with `LLM.generate`,
`async_beam_search` with `AsyncLLM.generate` (the server).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from llm_inference.outputs import CompletionOutput, RequestOutput
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


class BeamSearch:
    """The beams of several prompts. Each round: `batch()` (the live beams, to run one token
    each with `step_params`), then `advance(tops)` with each one's candidates ({token:
    logprob}, in batch order); `best()` at the end. `config`: the engine's EngineConfig."""

    def __init__(self, prompt_ids: list[list[int]], params: BeamSearchParams, config) -> None:
        self.params, self.max_len = params, config.scheduler.max_model_len
        self.eos = () if params.ignore_eos else tuple(config.model.eos_token_ids)
        self.live = [[BeamSearchSequence(list(ids))] for ids in prompt_ids]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
        self.step_params = SamplingParams(
            temperature=params.temperature, max_tokens=1, ignore_eos=True,
            logprobs=2 * params.beam_width, detokenize=False,
        )  # fmt: skip

    def _score(self, beam: BeamSearchSequence) -> float:
        """vLLM's score: cum_logprob / length ** length_penalty, a final EOS not counted."""
        tokens = beam.tokens
        length = len(tokens) - (1 if tokens and tokens[-1] in self.eos else 0)
        return beam.cum_logprob / length**self.params.length_penalty

    def batch(self) -> list[BeamSearchSequence]:
        """The live beams to extend this round (beams that fill the context complete first)."""
        for i, beams in enumerate(self.live):
            for b in beams:
                if len(b.tokens) >= self.max_len:
                    b.finish_reason = "length"
                    self.done[i].append(b)
            self.live[i] = [b for b in beams if len(b.tokens) < self.max_len]
        return [b for beams in self.live for b in beams]

    def advance(self, tops: list[dict[int, float]]) -> None:
        """Extend the beams of `batch()` by their candidates; keep each prompt's best."""
        tops_iter = iter(tops)
        for i, beams in enumerate(self.live):
            candidates = []
            for beam in beams:
                top = next(tops_iter)
                for token, logprob in top.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                             beam.cum_logprob + logprob)  # fmt: skip
                    if token in self.eos:
                        new.finish_reason = "stop"
                        self.done[i].append(new)
                    else:
                        candidates.append(new)
            candidates.sort(key=self._score, reverse=True)
            self.live[i] = candidates[: self.params.beam_width]

    def best(self) -> list[list[BeamSearchSequence]]:
        """Each prompt's beam_width best of its complete and live beams, best first."""
        out = []
        for beams, complete in zip(self.live, self.done):
            for b in beams:
                b.finish_reason = b.finish_reason or "length"
            ranked = sorted(complete + beams, key=self._score, reverse=True)
            out.append(ranked[: self.params.beam_width])
        return out


def beam_search(
    llm, prompt_ids: list[list[int]], params: BeamSearchParams, use_tqdm: bool = False
) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids) on an open `LLM`."""
    from tqdm.auto import tqdm

    search = BeamSearch(prompt_ids, params, llm.config)
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        batch = search.batch()
        if not batch:
            break
        outs = llm.generate([b.tokens for b in batch], search.step_params, use_tqdm=False)
        search.advance([o.outputs[0].logprobs[0].top for o in outs])
    results = []
    for best in search.best():
        for b in best:
            b.text = llm.tokenizer.decode(b.tokens)
        results.append(BeamSearchOutput(best))
    return results


async def async_beam_search(
    llm, prompt_ids: list[int], params: BeamSearchParams, request_id: str
) -> RequestOutput:
    """Beam search for one prompt on an `AsyncLLM`, as one finished RequestOutput whose
    `outputs` are the beams, best first (the generated part of each: tokens and text, the
    cumulative log-probability), as vLLM's server answers `use_beam_search`."""
    search = BeamSearch([prompt_ids], params, llm.config)

    async def one(k: int, tokens: list[int], round_: int) -> dict[int, float]:
        final = None
        async for out in llm.generate(tokens, search.step_params, f"{request_id}-{round_}-{k}"):
            final = out
        return final.outputs[0].logprobs[0].top

    for round_ in range(params.max_tokens):
        batch = search.batch()
        if not batch:
            break
        tops = await asyncio.gather(*(one(k, b.tokens, round_) for k, b in enumerate(batch)))
        search.advance(list(tops))
    (best,) = search.best()
    n = len(prompt_ids)
    outputs = [
        CompletionOutput(i, llm.tokenizer.decode(b.tokens[n:], skip_special_tokens=True),
                         b.tokens[n:], b.finish_reason, cumulative_logprob=b.cum_logprob)
        for i, b in enumerate(best)
    ]  # fmt: skip
    return RequestOutput(request_id, None, list(prompt_ids), outputs, True)
