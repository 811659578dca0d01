"""A pure-Python worker-side replay of SchedulerOutput diffs, for tests.

`BatchReplay.apply(output)` does what a worker's input batch does with a step (drop finished
and preempted requests, add new ones, append new tokens and blocks to cached ones) and returns
what the step asks to compute, one `ScheduledView` per request in batch order. It is an
independent oracle for `executor/input_batch.py` and lets scheduler tests read a step as
"request, start, tokens, needs a sample".
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from llm_inference.core.outputs import ModelRunnerOutput, SchedulerOutput
from llm_inference.core.scheduler import Scheduler


@dataclass
class ReplayState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: object
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class ScheduledView:
    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    needs_sample: bool
    sampling_params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class BatchReplay:
    def __init__(self) -> None:
        self.states: dict[str, ReplayState] = {}

    def apply(self, so: SchedulerOutput) -> list[ScheduledView]:
        for rid in so.finished_request_ids + so.preempted_request_ids:
            self.states.pop(rid, None)
        for new in so.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} sent twice"
            self.states[new.request_id] = ReplayState(
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
            )
        cached = so.cached_requests
        assert len(set(cached.request_ids)) == len(cached), "a request cached twice in a step"
        for rid, tokens, blocks, computed in zip(
            cached.request_ids, cached.new_token_ids, cached.new_block_ids,
            cached.num_computed_tokens, strict=True,
        ):  # fmt: skip
            state = self.states[rid]
            # Tokens the worker already has are the prompt plus earlier outputs.
            state.output_token_ids += tokens
            state.block_ids += blocks
            state.num_computed_tokens = computed
        views = []
        for rid, n in so.num_scheduled_tokens.items():
            state = self.states[rid]
            start = state.num_computed_tokens
            # Async scheduling: one token past the known ones is a sample still in flight
            # (None here; the worker takes it from the device).
            tokens = state.all_token_ids + [None]
            assert start + n <= len(tokens), f"{rid}: scheduled past its known tokens"
            views.append(
                ScheduledView(
                    request_id=rid,
                    token_ids=tokens[start : start + n],
                    start_position=start,
                    block_ids=list(state.block_ids),
                    needs_sample=start + n >= len(tokens) - 1,
                    sampling_params=state.sampling_params,
                    prompt_token_ids=list(state.prompt_token_ids),
                    output_token_ids=list(state.output_token_ids),
                )
            )
        return views


class Step:
    """A SchedulerOutput plus its replayed views (`.scheduled`); other attributes pass through."""

    def __init__(self, output: SchedulerOutput, scheduled: list[ScheduledView]) -> None:
        self.output = output
        self.scheduled = scheduled

    def __getattr__(self, name):
        return getattr(self.output, name)

    @property
    def num_batched_tokens(self) -> int:
        return self.output.total_num_scheduled_tokens


class ReplayScheduler(Scheduler):
    """A Scheduler whose every output goes through a pickle round trip and a BatchReplay,
    as if a worker process received it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replay = BatchReplay()

    def schedule(self) -> Step:  # type: ignore[override]
        out = super().schedule()
        wire = pickle.loads(pickle.dumps(out))
        assert wire == out, "a SchedulerOutput changed in a pickle round trip"
        return Step(out, self.replay.apply(wire))

    def update_from_output(self, step, model_runner_output: ModelRunnerOutput):  # type: ignore[override]
        so = step.output if isinstance(step, Step) else step
        return super().update_from_output(so, model_runner_output)
