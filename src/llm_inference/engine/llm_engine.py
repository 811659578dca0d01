"""LLMEngine: add_request / step / abort_request.

One step is schedule -> execute -> update (the core, which knows nothing of text) -> process
outputs (the front end: text, stop strings, n fan-in). `step()` returns a `RequestOutput` for
every user request that advanced, so callers can stream; a request's last one has
`finished=True`.

Async scheduling (`EngineConfig.async_scheduling`, on by default): `step()` schedules and
launches step n+1 before it waits for step n's tokens, so the host work of one step (schedule,
input building, updating and detokenizing the previous one) runs while the device computes.
The scheduler counts each sample in flight as a placeholder token, and the workers feed it to
the next step straight from the device. Requests with penalties or logprobs need every token
on the host first: while one is live, steps run one at a time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

from llm_inference.config import EngineConfig, cdiv
from llm_inference.core.request import Request, RequestStatus
from llm_inference.core.scheduler import Scheduler
from llm_inference.engine.output_processor import OutputProcessor
from llm_inference.executor.executor import Executor
from llm_inference.outputs import RequestOutput, RequestOutputKind
from llm_inference.sampling_params import SamplingParams


class KVCacheTooSmallError(ValueError):
    pass


def _needs_sync(params: SamplingParams) -> bool:
    """Penalties read every output token, and logprobs are built on the host each step."""
    return params.logprobs is not None or params.has_penalties


def child_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request with n > 1 (completion 0 keeps it)."""
    return seed if index == 0 else (seed * 1_000_003 + index) % (1 << 63)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.executor = Executor(config)
        try:
            num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
            self.config = self._fit_max_model_len(config, num_blocks)
            self.executor.collective_rpc("allocate_kv_cache", num_blocks)
        except BaseException:  # stop the worker processes of a half-built engine
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(
            self.config.scheduler,
            num_blocks,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.rng = random.Random(config.seed)
        self._pending = None  # (SchedulerOutput, PendingOutput) of the step in flight
        self._sync_ids: set[str] = set()  # live core requests that need synchronous steps

    def _fit_max_model_len(self, config: EngineConfig, num_blocks: int) -> EngineConfig:
        """The one KV-fits check: a request of max_model_len tokens must fit in the cache. When
        the user did not set max_model_len, it is capped to what the cache holds instead."""
        block_size, max_len = config.cache.block_size, config.scheduler.max_model_len
        if num_blocks * block_size >= max_len:
            return config
        if config.scheduler.max_model_len_is_default and num_blocks >= 1:
            fit = num_blocks * block_size
            print(
                f"llm_inference: max_model_len lowered from {max_len} to {fit} tokens, all "
                f"that the KV cache ({num_blocks} blocks) holds"
            )
            return replace(config, scheduler=replace(config.scheduler, max_model_len=fit))
        per_block = self.executor.collective_rpc("kv_bytes_per_block")[0]
        need = cdiv(max_len, block_size)
        raise KVCacheTooSmallError(
            f"KV cache too small for one request of max_model_len={max_len} tokens: it "
            f"needs {need} blocks of {block_size} tokens ({need * per_block:,} bytes) but "
            f"only {num_blocks} blocks ({num_blocks * per_block:,} bytes) fit; raise "
            "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
        )

    # ---- requests --------------------------------------------------------------------------

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a prompt this engine cannot run (before anything is added)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, not {type(params).__name__}")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not (type(t) is int and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        self.scheduler.check_request_length(len(prompt_token_ids), params.max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        stream: bool = True,
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """Queue a request (n > 1 becomes n core requests, one per completion). `step()`
        reports it every step it advances, or with `stream=False` only when it finishes.
        `output_kind` (default CUMULATIVE, or FINAL_ONLY with `stream=False`): DELTA reports
        only what each step added (see output_processor)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, not {type(request_id).__name__}")
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already running")
        self.validate_request(prompt_token_ids, params)
        # Every request gets a seed: its random stream never depends on its batch companions.
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        children = [replace(params, n=1, seed=child_seed(seed, j)) for j in range(params.n)]
        kind = output_kind or (
            RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
        )
        ids = self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, children, output_kind=kind
        )
        max_len = self.config.scheduler.max_model_len
        for cid, child in zip(ids, children):
            request = Request(
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
            self.scheduler.add_request(request)
            if _needs_sync(child):
                self._sync_ids.add(cid)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort user requests (unknown ids are ignored); returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            core_ids = self.output_processor.core_ids(rid)
            self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)
            self._sync_ids.difference_update(core_ids)
            out = self.output_processor.abort(rid)
            if out is not None:
                outputs.append(out)
        if self._pending is not None and not self.scheduler.has_unfinished_requests():
            self._finish_pending()  # only aborted requests were in flight: nothing to report
        return outputs

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every user request that advanced in it (with
        async scheduling: in the step launched before, whose tokens this one waited for)."""
        overlap = self.config.async_scheduling and not self._sync_ids
        outputs = [] if overlap else self._finish_pending()
        so = self.scheduler.schedule()
        launched = None
        if not so.is_empty:
            launched = (so, self.executor.execute_model(so, sync=not overlap))
        elif so.finished_request_ids or so.preempted_request_ids:
            self.executor.execute_model(so)  # nothing to run: the workers only drop states
        outputs += self._finish_pending()
        self._pending = launched
        if not overlap:
            outputs += self._finish_pending()
        return outputs

    def _finish_pending(self) -> list[RequestOutput]:
        """Wait for the step in flight, if any, and turn its tokens into outputs."""
        if self._pending is None:
            return []
        so, handle = self._pending
        self._pending = None
        core_outputs = self.scheduler.update_from_output(so, handle.result())
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self._sync_ids:
            done = [o.request_id for o in core_outputs if o.finished] + stopped
            self._sync_ids.difference_update(done)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pending is not None

    def stats(self) -> dict[str, int]:
        kv = self.scheduler.kv_cache_manager
        return {
            "num_kv_blocks": kv.num_blocks,
            "num_free_kv_blocks": kv.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.scheduler.num_steps,
            "num_unfinished_requests": self.scheduler.get_num_unfinished_requests(),
            "num_running_requests": len(self.scheduler.running),
            "num_waiting_requests": len(self.scheduler.waiting),
            # tokens of admitted requests, and those of them found in the prefix cache
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
        }

    def waiting_request_ids(self) -> set[str]:
        """Core ids of requests not yet scheduled (or preempted back to the queue): for the
        queue-time metric."""
        return {r.request_id for r in self.scheduler.waiting}

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
