"""What the scheduler sends to the workers, what comes back, and what the core reports.

`SchedulerOutput` is a diff against the workers' own per-request state (their persistent
input batch), never a view of the scheduler's: every list in it is a fresh copy, so it can be
pickled to another process or kept while the scheduler moves on.

- A request is sent whole once, as `NewRequestData`, when it is admitted (or readmitted after
  preemption, which discarded the workers' copy): prompt, tokens sampled so far, sampling
  parameters, block ids and how many tokens are already computed.
- Afterwards, each step that schedules it sends its entry of the step's `CachedRequestData`
  (one object of parallel lists for all of them, as vLLM's: no object per request per step):
  the tokens appended since it was last sent, the blocks added since, and its
  `num_computed_tokens`.
- `preempted_request_ids` and `finished_request_ids` tell the workers which states to drop.
  A worker applies a step in this order: drop finished, drop preempted, add new, update cached.

The batch order of a step is the key order of `num_scheduled_tokens`. Request `r` computes
positions `[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[r])`; it needs a
sample when that range reaches the end of its known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_inference.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only for a request readmitted after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """The step's requests the workers already hold; entry i of each list is request i's."""

    request_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since last sent
    new_block_ids: list[list[int]] = field(default_factory=list)  # added to its block table
    num_computed_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class SchedulerOutput:
    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute, in batch order
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    # Structured outputs: the step's requests with a grammar that sample, in batch order, and
    # their token bitmask, which the engine core fills after scheduling (opaque here: an int32
    # array [len(ids), ceil(vocab_size / 32)], bit v % 32 of word v // 32 allowing token v).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: object | None = None

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def request_ids(self) -> list[str]:
        """The scheduled requests in batch order."""
        return list(self.num_scheduled_tokens)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens per request, in the batch order of the step.

    `sampled_token_ids[i]` is `[]` for a request whose chunk did not need a sample.
    `logprobs` is opaque to the scheduler and passed through in the core's outputs.
    """

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[object | None] | None = None
    # request id -> (first prompt position, [Logprobs of the token after each position]) for
    # the prompt tokens this step ran of requests that asked for prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list]] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What the core reports for one request that advanced in a step: plain values only.

    `new_token_ids` are the tokens appended in this step (a request that finishes on a stop
    token includes it). `finish_reason` is "stop", "length", "abort" or None while it runs;
    `stop_reason` is the stop token id when one of the request's stop_token_ids ended it
    (None for an EOS token, as in vLLM), and with "abort" the core's error where the core ended
    the request (a grammar that failed to compile). `prompt_logprobs` (a request that asked for
    them, in its first record): None, then one Logprobs per prompt token after the first.
    `output_token_ids`, in a request's finishing record only: every output token it made (so a
    front end that wants only the end may skip the records before it).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[object] | None = None
    prompt_logprobs: list[object | None] | None = None
    output_token_ids: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):
        """Pickled as the arguments of its constructor: a running request's record (most of
        a step's) as two values. A slots dataclass pickles its fields by name by default,
        which takes twice the time each way for the core's sender and the front end's
        reader, every step (benchmarks/DECISIONS.md, the server's per-token work)."""
        rest = (self.finish_reason, self.stop_reason, self.new_logprobs, self.prompt_logprobs,
                self.output_token_ids)  # fmt: skip
        if rest == (None, None, None, None, None):
            return EngineCoreOutput, (self.request_id, self.new_token_ids)
        return EngineCoreOutput, (self.request_id, self.new_token_ids, *rest)


def merge_steps(steps: list[list[EngineCoreOutput]]) -> list[EngineCoreOutput]:
    """Consecutive steps' records as one step's: a record per request (in order of first
    appearance) with the steps' new tokens and logprobs concatenated, its first prompt
    logprobs and its last finish. A front end that finds several steps waiting processes them
    at once (one output per request, not one per request and step). Records are not changed."""
    if len(steps) == 1:
        return steps[0]
    merged: dict[str, EngineCoreOutput] = {}
    for records in steps:
        for r in records:
            m = merged.get(r.request_id)
            merged[r.request_id] = r if m is None else EngineCoreOutput(
                r.request_id, m.new_token_ids + r.new_token_ids, r.finish_reason,
                r.stop_reason, _joined(m.new_logprobs, r.new_logprobs),
                m.prompt_logprobs if m.prompt_logprobs is not None else r.prompt_logprobs,
                r.output_token_ids,
            )  # fmt: skip
    return list(merged.values())


def _joined(a: list | None, b: list | None) -> list | None:
    return b if a is None else a if b is None else a + b
