"""What a request gives back: RequestOutput holding one CompletionOutput per sample (n).

Plain dataclasses, no torch: the sampler fills `Logprobs`, the engine builds the rest.

A request's outputs come in one of three kinds (`RequestOutputKind`, as vLLM's): CUMULATIVE
(everything so far, every time), DELTA (only what is new since the previous output: new text,
new token ids, new logprobs, and only the completions that advanced) or FINAL_ONLY (one
cumulative output when the request finishes). `merge_deltas` joins consecutive deltas into one
and `accumulate` folds deltas into a cumulative output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprobs:
    """Log-probabilities for one sampled token, from log_softmax of the raw logits
    (before penalties, temperature and filtering), as vLLM v1 reports them.

    `top` holds the k most likely tokens (k = SamplingParams.logprobs), most likely first;
    the sampled token may or may not be among them.
    """

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


_copy_lps = lambda lps: None if lps is None else list(lps)  # noqa: E731


@dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[Logprobs] | None = None  # one per token in token_ids when requested
    # the stop_token_ids entry or stop string (EOS: None); with "abort", the engine's error
    # where the engine ended the request (a grammar that failed to compile; AsyncLLM raises it)
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy(self) -> CompletionOutput:
        """A copy whose lists are its own."""
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason,
                                _copy_lps(self.logprobs), self.stop_reason,
                                self.cumulative_logprob)  # fmt: skip

    def add(self, delta: CompletionOutput) -> None:
        """Append a later delta of the same completion (in place)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.cumulative_logprob = delta.cumulative_logprob


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its n completions.

    `text`, `token_ids`, `finish_reason` and `logprobs` are shortcuts to `outputs[0]`.
    `prompt_logprobs` (SamplingParams.prompt_logprobs): one entry per prompt token, None for the
    first, then Logprobs of that token given the ones before it (from log_softmax of the raw
    logits) with the k most likely tokens there in `top`. A DELTA output carries them once.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[Logprobs] | None:
        return self.outputs[0].logprobs


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive DELTA outputs of one request as one delta (the same concatenated text,
    token ids and logprobs; the latest finish state). A single delta is returned as is."""
    if len(deltas) == 1:
        return deltas[0]
    merged: dict[int, CompletionOutput] = {}
    for d in deltas:
        for c in d.outputs:
            if c.index in merged:
                merged[c.index].add(c)
            else:
                merged[c.index] = c.copy()
    last = deltas[-1]
    outputs = [merged[i] for i in sorted(merged)]
    prompt_lps = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, outputs,
                         last.finished, prompt_lps)  # fmt: skip


def accumulate(total: RequestOutput | None, delta: RequestOutput, n: int = 1) -> RequestOutput:
    """Fold a DELTA output into the cumulative output `total` (in place; None: start one with
    `n` empty completions) and return it."""
    if total is None:
        empty = [CompletionOutput(j, "", [], None) for j in range(n)]
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, empty,
                              False)  # fmt: skip
    for c in delta.outputs:
        total.outputs[c.index].add(c)
    total.finished = delta.finished
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    return total


def copy_output(out: RequestOutput) -> RequestOutput:
    """A copy of `out` whose lists are its own."""
    return RequestOutput(out.request_id, out.prompt, list(out.prompt_token_ids),
                         [c.copy() for c in out.outputs], out.finished,
                         _copy_lps(out.prompt_logprobs))  # fmt: skip
