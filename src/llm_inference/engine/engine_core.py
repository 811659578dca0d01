"""EngineCore: the scheduler and the executor, stepping; no text, no tokenizer.

One step is schedule -> execute -> update. The core takes whole `Request`s (the front end,
`LLMEngine`, builds them: seeds, n fan-out) and reports plain `EngineCoreOutput` records, so
it can run in the caller's thread (`LLM`) or in a process of its own (`core_process`, the
server's default) with the front end on the other side of a pipe. Every step reports the new
tokens of every request that got some; what a caller sees of them (each step, or only the end)
is the front end's choice (engine/output_processor.py).

Start: the core decides the final max_model_len once, from the KV-cache blocks the workers
found room for (`_fit_max_model_len`), and sends it to every worker with the block count.

Async scheduling (`EngineConfig.async_scheduling`, ARCHITECTURE.md "One step"): `step()`
launches step n+1 before it waits for step n's tokens, except while a request on
`SamplingPath.SYNC` is live: then steps run one at a time.

Structured outputs (structured_output/): a request's grammar compiles on the manager's
threads while the scheduler passes it over. A step with constrained rows needs a token bitmask
(`SchedulerOutput.grammar_bitmask`) that the matchers fill once they have every token before
it, so under async scheduling such a step goes out in two calls, as vLLM's: the forward of
step n+1 first, then (step n's tokens read, the matchers advanced, the bitmask filled) its
sampling. The host's work thus still overlaps the device's forward. A request that step n's
token finished may have a row in step n+1: every token is allowed there, and the token is
discarded, as any finished request's in flight. Without async scheduling, or in a step without
constrained rows, a step is one call. A grammar that fails to compile finishes its request
with finish reason "abort".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from llm_inference.config import EngineConfig, cdiv
from llm_inference.core.outputs import EngineCoreOutput, SchedulerOutput
from llm_inference.core.request import Request, RequestStatus
from llm_inference.core.scheduler import Scheduler
from llm_inference.executor.executor import Executor
from llm_inference.models.loader import load_tokenizer
from llm_inference.sampling_params import SamplingPath
from llm_inference.structured_output import StructuredOutputManager

# An engine with nothing to run but requests whose grammar compiles waits this long at most
# for one (then steps again: a command, an abort, may be waiting).
GRAMMAR_WAIT_S = 0.05


class KVCacheTooSmallError(ValueError):
    pass


class EngineCore:
    """Owns the scheduler and the executor. `config` is the engine's one resolved config: its
    `scheduler.max_model_len` is final (fitted to the KV cache once, at start), and it is the
    value the scheduler, the workers and the front end all use."""

    def __init__(self, config: EngineConfig) -> None:
        self.executor = Executor(config)
        try:
            num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
            max_model_len = self._fit_max_model_len(config, num_blocks)
            self.executor.collective_rpc("allocate_kv_cache", num_blocks, max_model_len)
        except BaseException:  # stop the worker processes of a half-built engine
            self.executor.shutdown()
            raise
        self.config = replace(
            config, scheduler=replace(config.scheduler, max_model_len=max_model_len)
        )
        self.scheduler = Scheduler(
            self.config.scheduler,
            num_blocks,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self._pending = None  # (SchedulerOutput, PendingOutput) of the step in flight
        self._sync_ids: set[str] = set()  # live requests that need synchronous steps
        self.structured = StructuredOutputManager(
            lambda: load_tokenizer(config.model_path), config.model.vocab_size,
            config.model.eos_token_ids,
        )  # fmt: skip

    def _fit_max_model_len(self, config: EngineConfig, num_blocks: int) -> int:
        """The final max_model_len, decided once: a request of max_model_len tokens must fit in
        the `num_blocks` the workers found room for. The config's value came from the model
        (lowered to what the cache holds, said in one line) or from the user (an error if it
        does not fit)."""
        block_size, max_len = config.cache.block_size, config.scheduler.max_model_len
        if num_blocks * block_size >= max_len:
            return max_len
        if config.scheduler.max_model_len_is_default and num_blocks >= 1:
            fit = num_blocks * block_size
            print(
                f"llm_inference: max_model_len lowered from {max_len} to {fit} tokens, all "
                f"that the KV cache ({num_blocks} blocks) holds"
            )
            return fit
        per_block = self.executor.collective_rpc("kv_bytes_per_block")[0]
        need = cdiv(max_len, block_size)
        raise KVCacheTooSmallError(
            f"KV cache too small for one request of max_model_len={max_len} tokens: it "
            f"needs {need} blocks of {block_size} tokens ({need * per_block:,} bytes) but "
            f"only {num_blocks} blocks ({num_blocks * per_block:,} bytes) fit; raise "
            "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
        )

    # ---- requests --------------------------------------------------------------------------

    def add_requests(self, requests: list[Request]) -> None:
        """Queue requests the front end has validated (their ids are new)."""
        for request in requests:
            self.scheduler.add_request(request)
            params = request.sampling_params
            if params.structured_outputs is not None:
                self.structured.add(request)
            if params.sampling_path is SamplingPath.SYNC:
                self._sync_ids.add(request.request_id)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (an abort, a stop string); unknown ids are ignored.
        Their blocks are free before the next step."""
        ids = list(request_ids)
        self.scheduler.finish_requests(ids, status)
        self._sync_ids.difference_update(ids)
        if self._pending is not None and not self.scheduler.has_unfinished_requests():
            self._update()  # only finished requests were in flight: nothing to report

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update: return the records of every request that advanced.

        Overlapped (async scheduling, no synchronous request live): step n+1 is scheduled and
        launched first, then step n's tokens are awaited and applied, so the records are those
        of the step launched before. Otherwise the step runs to its end before returning."""
        overlap = self.config.async_scheduling and not self._sync_ids
        outputs = [] if overlap else self._update()  # what steps left in flight when overlapped
        if self.structured.compiling:
            outputs += self._finish_failed_grammars()
        so = self.scheduler.schedule()
        if so.is_empty and self._pending is None and self.structured.compiling:
            self.structured.wait(GRAMMAR_WAIT_S)  # nothing runs until a grammar compiles
        if not overlap:
            self._pending = self._execute(so, sync=True)
            return outputs + self._update()
        if so.structured_output_request_ids:  # the mask needs step n's tokens: sample later
            self.executor.execute_model(so, sync=False, sample=False)
            outputs += self._update()
            so.grammar_bitmask = self._fill_bitmask(so)
            self._pending = so, self.executor.sample_tokens(so.grammar_bitmask)
            return outputs
        launched = self._execute(so, sync=False)
        outputs += self._update()
        self._pending = launched
        return outputs

    def _execute(self, so: SchedulerOutput, sync: bool):
        """Launch a scheduled step on the workers: (so, handle to its tokens), or None when it
        runs nothing (finished or preempted ids still go out: the workers drop those states)."""
        if so.is_empty:
            if so.finished_request_ids or so.preempted_request_ids:
                self.executor.execute_model(so)
            return None
        if so.structured_output_request_ids:
            so.grammar_bitmask = self._fill_bitmask(so)
        return so, self.executor.execute_model(so, sync=sync)

    def _fill_bitmask(self, so: SchedulerOutput):
        """The step's grammar bitmask, from every token its requests have so far."""
        return self.structured.fill_bitmask(
            so.structured_output_request_ids, self.scheduler.requests
        )

    def _finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Finish the requests whose grammar failed to compile: a finishing record each."""
        outputs = []
        for request, error in self.structured.take_failed():
            print(f"llm_inference: request {request.request_id!r}: grammar failed: {error}")
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            self._sync_ids.discard(request.request_id)
            outputs.append(EngineCoreOutput(request.request_id, [], "abort", output_token_ids=[]))
        return outputs

    def _update(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight, if any, and update the scheduler with its tokens."""
        if self._pending is None:
            return []
        so, handle = self._pending
        self._pending = None
        outputs = self.scheduler.update_from_output(so, handle.result())
        if self._sync_ids:
            self._sync_ids.difference_update(o.request_id for o in outputs if o.finished)
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
        """Ids of requests not yet scheduled (or preempted back to the queue): for the
        queue-time metric."""
        return {r.request_id for r in self.scheduler.waiting}

    def start_profile(self, trace_dir: str | None = None) -> None:
        self.executor.collective_rpc("start_profile", trace_dir)

    def stop_profile(self) -> list[dict]:
        """Each rank's summary (executor/profiler.py), in rank order."""
        return self.executor.collective_rpc("stop_profile")

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
