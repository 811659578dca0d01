"""Request: one prompt's journey through the scheduler, and its status.

Invariants (kept by the scheduler and the KV cache manager):

- The prompt is not empty and shorter than max_model_len (the front end's one length check,
  engine/llm_engine.py, refuses other requests before they reach the core).
- `all_token_ids == prompt_token_ids + output_token_ids`; the first `num_computed_tokens` of
  them (of them plus `num_output_placeholders` samples still in flight) have their K/V written
  in the paged cache once the scheduled steps ran, in `block_ids` (logical block i -> physical
  block `block_ids[i]`), so `len(block_ids) * block_size >= num_computed_tokens`.
- A WAITING or PREEMPTED request owns no blocks and has `num_computed_tokens == 0`;
  preemption frees its blocks (the full ones stay in the prefix cache until evicted), so a
  readmitted request starts from its longest cached prefix (admission sets
  `num_computed_tokens` to it, whole blocks, always short of the last token) and recomputes
  the rest. Preemption also discards the workers' copy (`num_sent_tokens is None`): it is
  sent whole again when readmitted.
- Prefix caching: `block_hashes[i]` is the chained hash of full block i of `all_token_ids`
  (filled on demand, valid forever since tokens are append-only); `cache_keys[i]` is the
  cache key of the cached block holding the same contents as its block i, for its first
  `len(cache_keys) <= len(block_ids)` blocks (cleared with the block table).
- A finished request owns no blocks.
"""

from __future__ import annotations

import enum
import sys

from llm_inference.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Token ids, progress (`num_computed_tokens`) and block table of one sequence.

    `max_tokens` is the resolved limit of new tokens: the engine passes it (for example
    derived from max_model_len when `sampling_params.max_tokens` is None); otherwise it is
    `sampling_params.max_tokens`, or unlimited (the scheduler still stops at max_model_len).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_tokens = len(self.prompt_token_ids)  # prompt + outputs, kept by append
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        # Tokens that may stop the request (`Scheduler._check_stop` decides, min_tokens
        # included): the scheduler looks at a sampled token closely only if it is one of these.
        eos = () if sampling_params.ignore_eos else self.eos_token_ids
        self.stop_token_set = frozenset(eos) | frozenset(sampling_params.stop_token_ids)
        if max_tokens is None:
            max_tokens = sampling_params.max_tokens
        self.max_tokens: int = sys.maxsize if max_tokens is None else int(max_tokens)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cache_keys: list[int] = []
        self.stop_reason: int | str | None = None
        # What the workers hold of this request (their copy is dropped on preemption): the
        # first `num_sent_tokens` token ids and `num_sent_blocks` block ids. `None` until the
        # request is first sent whole as NewRequestData.
        self.num_sent_tokens: int | None = None
        self.num_sent_blocks = 0
        # Samples scheduled but not yet returned (async scheduling: at most one). The workers
        # feed such a token to the next step straight from the device.
        self.num_output_placeholders = 0
        # prompt_logprobs: the prompt positions' Logprobs so far (a recomputed prompt after a
        # preemption adds nothing twice), reported with the request's first record
        self.prompt_logprobs: list | None = None if sampling_params.prompt_logprobs is None else []
        self.prompt_logprobs_sent = False
        # Structured outputs: the request's grammar (structured_output/: compiled off the step
        # loop, then its matcher), set by the engine core; None without. The scheduler
        # admits the request once `grammar.ready` and lists it in each step that samples it.
        self.grammar = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "abort" once finished, else None."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
