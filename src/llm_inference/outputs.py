"""What a request gives back: RequestOutput holding one CompletionOutput per sample (n).

Plain dataclasses, no torch: the sampler fills `Logprobs`, the engine builds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[Logprobs] | None = None  # one per token in token_ids when requested
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its n completions.

    `text`, `token_ids`, `finish_reason` and `logprobs` are shortcuts to `outputs[0]`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

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
