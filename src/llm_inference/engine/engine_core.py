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

Structured outputs (structured_output/): a request's grammar compiles on the manager's threads
while the scheduler passes it over. A step with constrained rows needs a token bitmask
(`SchedulerOutput.grammar_bitmask`) that the matchers fill once they have every token before
it, so under async scheduling such a step goes out in two parts, over two calls: one call
launches the forward of step n+1 and returns; the next reads step n's tokens, advances the
matchers, fills the bitmask and launches step n+1's sampling, then schedules and launches step
n+2. The device runs that sampling and the next forward back to back, and the host's work
between calls (the caller's output processing, the fill) overlaps a forward. A request that
step n's token finished may have a row in step n+1: every token is allowed there, and the token
is discarded, as any finished request's in flight. Without async scheduling, or in a step
without constrained rows, a step is one call. A grammar that fails to compile finishes its
request with finish reason "abort".
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


def one_record_each(first: list[EngineCoreOutput], second: list[EngineCoreOutput]):
    """The records of two steps read in one call, with one record per request, as front ends
    read them (engine/output_processor.py): a request in both gets one, its tokens in order."""
    if not first or not second:
        return first or second
    merged = {o.request_id: o for o in first}
    for o in second:
        a = merged.get(o.request_id)
        if a is not None:
            logprobs = None if o.new_logprobs is None else (a.new_logprobs or []) + o.new_logprobs
            prompt_logprobs = o.prompt_logprobs if a.prompt_logprobs is None else a.prompt_logprobs
            o = EngineCoreOutput(
                o.request_id, a.new_token_ids + o.new_token_ids, o.finish_reason,
                o.stop_reason, logprobs, prompt_logprobs, o.output_token_ids,
            )  # fmt: skip
        merged[o.request_id] = o
    return list(merged.values())


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
        self._unsampled = None  # SchedulerOutput of a step launched without its sampling
        self._sync_ids: set[str] = set()  # live requests that need synchronous steps
        self.structured = StructuredOutputManager(
            lambda: load_tokenizer(config.model_path), config.model.vocab_size,
            config.model.eos_token_ids, self.executor.grammar_bitmask_buffer,
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
        if not self.scheduler.has_unfinished_requests():
            # Only finished requests were in flight: end their steps, nothing to report.
            if self._unsampled is not None:
                self._launch_sampling()
            self._update()

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update: return the records of every request that advanced.

        Overlapped (async scheduling, no synchronous request live): step n+1 is scheduled and
        launched first, then step n's tokens are awaited and applied, so the records are those
        of the step launched before. A step with constrained rows is launched without its
        sampling, which the next call adds once step n's tokens have filled the bitmask,
        before it schedules and launches the step after (see the module docstring).
        Otherwise the step runs to its end before returning."""
        overlap = self.config.async_scheduling and not self._sync_ids
        outputs = [] if self._unsampled is None else self._launch_sampling()
        if not overlap:  # what steps left in flight when overlapped
            outputs = one_record_each(outputs, self._update())
        if self.structured.compiling:
            outputs += self._finish_failed_grammars()
        so = self.scheduler.schedule()
        if so.is_empty and self._pending is None and self.structured.compiling:
            self.structured.wait(GRAMMAR_WAIT_S)  # nothing runs until a grammar compiles
        if not overlap:
            self._pending = self._execute(so, sync=True)
            return one_record_each(outputs, self._update())
        if so.structured_output_request_ids:  # sampled in the next call, after step n's update
            self.executor.execute_model(so, sync=False, sample=False)
            self._unsampled = so
            return outputs
        launched = self._execute(so, sync=False)
        outputs = one_record_each(outputs, self._update())
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

    def _launch_sampling(self) -> list[EngineCoreOutput]:
        """Launch the sampling of the step whose forward went out without it, once the step in
        flight before it is read (its records returned) and the bitmask filled."""
        so, self._unsampled = self._unsampled, None
        outputs = self._update()
        so.grammar_bitmask = self._fill_bitmask(so)
        self._pending = so, self.executor.sample_tokens(so.grammar_bitmask)
        return outputs

    def _fill_bitmask(self, so: SchedulerOutput):
        """The step's grammar bitmask, from every token its requests have so far."""
        return self.structured.fill_bitmask(
            so.structured_output_request_ids, self.scheduler.requests
        )

    def _finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Finish the requests whose grammar failed to compile: a finishing record each, with
        finish reason "abort" and the error, naming the spec, as its stop_reason."""
        outputs = []
        for request, error in self.structured.take_failed():
            print(f"llm_inference: request {request.request_id!r}: grammar failed: {error}")
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            self._sync_ids.discard(request.request_id)
            kind = request.sampling_params.structured_outputs.kind
            why = f"structured_outputs.{kind}: xgrammar failed to compile the grammar: {error}"
            outputs.append(EngineCoreOutput(request.request_id, [], "abort", why, []))
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
        return (
            self.scheduler.has_unfinished_requests()
            or self._pending is not None
            or self._unsampled is not None
        )

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
