"""What the scheduler asks the model runner to compute, and what comes back (dataclasses only)."""

from __future__ import annotations

from dataclasses import dataclass

from llm_inference.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's work in a step.

    `token_ids == all_token_ids[start_position : start_position + len(token_ids)]`; their K/V
    go to the slots `slot_mapping(block_ids, start_position, len(token_ids), block_size)`.
    `needs_sample` is True iff the chunk reaches the end of the known tokens, so the logits of
    its last token give the request's next token.

    `prompt_token_ids` and `output_token_ids` are the request's own lists (not copies): read
    them before `Scheduler.update_from_output`, never mutate them. `block_ids` is a copy.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    needs_sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """The batch of one step, in batch order (running requests first, then admitted ones)."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per request, in the order of `SchedulerOutput.scheduled`.

    `sampled_token_ids[i]` is `[]` for a request whose chunk did not need a sample.
    `logprobs` is opaque to the scheduler and passed through to the engine.
    """

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[object | None] | None = None
