"""LLMEngine: add_request / step / abort_request, the front end over an EngineCore.

One step is the core's schedule -> execute -> update (engine_core.py, which knows nothing of
text) followed by the front end's output processing (text, stop strings, n fan-in, and what
each request's output kind shows of it). `step()` returns a `RequestOutput` for every user
request that advanced and wants to hear of it, so callers can stream; a request's last one has
`finished=True`.

Requests enter here: `add_request` is where every request (of `LLM`, `AsyncLLM` and the server)
is checked, once, before the core sees it; `check_request_length` is the one length check.
`config` is the core's (its max_model_len is the final one, fitted to the KV cache).

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
from llm_inference.engine.engine_core import EngineCore, KVCacheTooSmallError
from llm_inference.engine.output_processor import OutputProcessor
from llm_inference.outputs import RequestOutput, RequestOutputKind
from llm_inference.sampling_params import SamplingParams
from llm_inference.structured_output import check_spec

__all__ = ["KVCacheTooSmallError", "LLMEngine", "check_request_length", "child_seed"]


def check_request_length(max_len: int, num_prompt_tokens: int, max_tokens: int | None) -> None:
    """The one prompt-length check: raise ValueError unless the prompt is non-empty, shorter
    than max_model_len (room for one output token), and prompt + max_tokens fits."""
    if num_prompt_tokens < 1:
        raise ValueError("the prompt is empty")
    if num_prompt_tokens >= max_len:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate "
            f"within max_model_len={max_len}"
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_len:
        raise ValueError(
            f"{num_prompt_tokens} prompt tokens + max_tokens={max_tokens} = "
            f"{num_prompt_tokens + max_tokens} exceeds max_model_len={max_len}"
        )


def child_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request with n > 1 (completion 0 keeps it)."""
    return seed if index == 0 else (seed * 1_000_003 + index) % (1 << 63)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer, core=None) -> None:
        """`core`: an EngineCore-like object (default: an `EngineCore` built here)."""
        self.tokenizer = tokenizer
        self.core = core if core is not None else EngineCore(config)
        self.output_processor = OutputProcessor(tokenizer)
        self.rng = random.Random(config.seed)

    @property
    def config(self) -> EngineConfig:
        """The core's config: the one resolved at start (max_model_len fitted to the cache)."""
        return self.core.config

    @property
    def max_model_len(self) -> int:
        return self.core.config.scheduler.max_model_len

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
            k = self.max_model_len
        return prompt_token_ids if k is None else prompt_token_ids[-k:]

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a prompt this engine cannot run. `add_request` calls it (before
        anything is added); so does a caller that runs the prompt otherwise (beam search)."""
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
        check_request_length(self.max_model_len, len(prompt_token_ids), params.max_tokens)
        if params.structured_outputs is not None:
            check_spec(params.structured_outputs)  # the grammar parses: a ValueError names why

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        stream: bool = True,
        output_kind: RequestOutputKind | None = None,
    ) -> list[str]:
        """Queue a request (n > 1 becomes n core requests, one per completion; their ids are
        returned). `step()` reports it every step it advances, or with `stream=False` only when
        it finishes. `output_kind` (default CUMULATIVE, or FINAL_ONLY with `stream=False`):
        DELTA reports only what each step added (see output_processor). Raises (TypeError,
        ValueError; nothing is added) for a request `validate_request` refuses."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, not {type(request_id).__name__}")
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already running")
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
        room = self.max_model_len - len(prompt_token_ids)  # max_tokens when unset
        eos = self.config.model.eos_token_ids
        requests = [
            Request(cid, list(prompt_token_ids), child, eos, child.max_tokens or room)
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
        """Schedule, execute, update (the core), then process: the outputs of every user
        request that advanced in the step (with async scheduling: the step launched before,
        whose tokens it waited for) and whose output kind reports it."""
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
