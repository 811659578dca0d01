"""LLMEngine: add_request / step / abort_request, the front end over an EngineCore.

One step is the core's schedule -> execute -> update (engine_core.py, which knows nothing of
text) followed by the front end's output processing (text, stop strings, n fan-in). `step()`
returns a `RequestOutput` for every user request that advanced, so callers can stream; a
request's last one has `finished=True`.

The front end builds the core's `Request`s (a seed for each, one per completion when n > 1)
and keeps the `OutputProcessor`; the core can be in this thread (`EngineCore`) or in a process
of its own (`core_process.CoreClient`, which the server's AsyncLLM uses): then the caller feeds
the core's outputs to `process_core_outputs` instead of calling `step()`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

from llm_inference.config import EngineConfig
from llm_inference.core.outputs import EngineCoreOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.core.scheduler import check_request_length
from llm_inference.engine.engine_core import EngineCore, KVCacheTooSmallError
from llm_inference.engine.output_processor import OutputProcessor
from llm_inference.outputs import RequestOutput, RequestOutputKind
from llm_inference.sampling_params import SamplingParams

__all__ = ["KVCacheTooSmallError", "LLMEngine", "child_seed"]


def child_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request with n > 1 (completion 0 keeps it)."""
    return seed if index == 0 else (seed * 1_000_003 + index) % (1 << 63)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer, core=None) -> None:
        """`core`: an EngineCore-like object (default: an `EngineCore` built here)."""
        self.tokenizer = tokenizer
        self.core = core if core is not None else EngineCore(config)
        self.config = self.core.config  # max_model_len may have been fitted to the cache
        self.output_processor = OutputProcessor(tokenizer)
        self.rng = random.Random(config.seed)

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def executor(self):
        return self.core.executor

    # ---- requests --------------------------------------------------------------------------

    def truncated(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the request runs it: its last `truncate_prompt_tokens` tokens (-1: the
        last max_model_len), or all of it."""
        k = params.truncate_prompt_tokens
        if k == -1:
            k = self.config.scheduler.max_model_len
        return prompt_token_ids if k is None else prompt_token_ids[-k:]

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a prompt this engine cannot run (before anything is added)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, not {type(params).__name__}")
        vocab = self.config.model.vocab_size
        ids = prompt_token_ids = self.truncated(prompt_token_ids, params)
        plain = isinstance(ids, list) and set(map(type, ids)) <= {int}  # builtins: C speed
        if not (plain and (not ids or (min(ids) >= 0 and max(ids) < vocab))):
            bad = [t for t in ids if not (type(t) is int and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        for name in ("logit_bias", "allowed_token_ids"):
            bad = sorted(t for t in getattr(params, name) or () if t >= vocab)
            if bad:
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab}): "
                                 f"{bad[:5]}")  # fmt: skip
        check_request_length(
            self.config.scheduler.max_model_len, len(prompt_token_ids), params.max_tokens
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        stream: bool = True,
        output_kind: RequestOutputKind | None = None,
        validated: bool = False,
    ) -> list[str]:
        """Queue a request (n > 1 becomes n core requests, one per completion; their ids are
        returned). `step()` reports it every step it advances, or with `stream=False` only when
        it finishes. `output_kind` (default CUMULATIVE, or FINAL_ONLY with `stream=False`):
        DELTA reports only what each step added (see output_processor). `validated`: the caller
        has just passed these to `validate_request` (LLM.generate checks every prompt before
        adding any), so their checks, three passes over the prompt, are not run again."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, not {type(request_id).__name__}")
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already running")
        if not validated:
            self.validate_request(prompt_token_ids, params)
        prompt_token_ids = self.truncated(prompt_token_ids, params)
        # Every request gets a seed: its random stream never depends on its batch companions.
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        params = params.with_token_ids(self.tokenizer)  # tokenized once, for every child
        children = [replace(params, n=1, seed=child_seed(seed, j)) for j in range(params.n)]
        kind = output_kind or (
            RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
        )
        ids = self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, children, output_kind=kind
        )
        max_len = self.config.scheduler.max_model_len
        requests = [
            Request(
                cid,
                list(prompt_token_ids),
                child,
                eos_token_ids=self.config.model.eos_token_ids,
                max_tokens=child.max_tokens or max_len - len(prompt_token_ids),
                # Nothing is read before the end: no per-step records to make or process.
                final_only=kind is RequestOutputKind.FINAL_ONLY
                and not child.stop_strings
                and child.logprobs is None,
            )
            for cid, child in zip(ids, children)
        ]
        self.core.add_requests(requests)
        return ids

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort user requests (unknown ids are ignored); returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs, core_ids = [], []
        for rid in ids:
            core_ids += self.output_processor.core_ids(rid)
            out = self.output_processor.abort(rid)
            if out is not None:
                outputs.append(out)
        if core_ids:
            self.core.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)
        return outputs

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step of the core; return the outputs of every user request that advanced in
        it (with async scheduling: in the step launched before, whose tokens it waited for)."""
        return self.process_core_outputs(self.core.step())

    def process_core_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The front end's half of a step: the core's records -> RequestOutputs; completions
        that a stop string ended are finished in the core."""
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    def waiting_request_ids(self) -> set[str]:
        """Core ids of requests not yet scheduled (or preempted back to the queue): for the
        queue-time metric."""
        return self.core.waiting_request_ids()

    def shutdown(self) -> None:
        self.core.shutdown()
