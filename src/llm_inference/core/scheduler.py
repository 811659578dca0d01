"""Continuous batching: one token budget per step, chunked prefill, recompute preemption.

There is no prefill phase and no decode phase. Each request needs
`num_tokens - num_computed_tokens` tokens computed (its whole prompt when new, one token when
decoding, prompt + outputs when readmitted after preemption); `schedule()` hands out the
step's budget of `max_num_batched_tokens`:

1. RUNNING requests, oldest first, each get `min(needed, budget left)` tokens (and at most
   `long_prefill_token_threshold` where that is set: a long prompt's chunk). When the KV
   cache has no room, the newest running request is preempted (blocks freed, progress
   reset, put at the front of the waiting queue) and allocation is retried; if the request
   being scheduled is itself the newest, it is preempted and the step stops there.
2. If nobody was preempted, WAITING requests are admitted in FIFO order while budget and
   `max_num_seqs` allow; admission stops at the first request that cannot get blocks, and
   passes over requests whose grammar (structured outputs) still compiles. With
   prefix caching, an admitted (or readmitted) request starts from its longest cached prefix:
   `num_computed_tokens` = the hit, whole shared blocks (sent to the workers as already
   computed), and only the rest counts against the budget. Blocks are entered into the
   cache in `update_from_output`, once their tokens are computed.

Ownership: `running` and `waiting` are disjoint, and `requests` holds exactly the requests
in either; only running requests own blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from llm_inference.config import SchedulerConfig
from llm_inference.core.kv_cache_manager import KVCacheManager
from llm_inference.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from llm_inference.core.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.config = scheduler_config
        # The most tokens one request computes in a step (long_prefill_token_threshold).
        self.max_chunk = (
            scheduler_config.long_prefill_token_threshold or scheduler_config.max_model_len
        )
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self._step_id = 0
        # Requests of each step not yet passed to update_from_output (by step id).
        # Per step: each request, whether it samples, and its computed tokens once it ran.
        self._in_flight: dict[int, list[tuple[Request, bool, int]]] = {}
        # Ids the workers hold state for that finished since the last SchedulerOutput.
        self._finished_ids: list[str] = []

    def add_request(self, request: Request) -> None:
        """Queue a new request. The front end has checked its length (engine/llm_engine.py):
        its prompt is not empty and leaves room for output within max_model_len, so
        `num_tokens <= max_model_len` always holds. It must also fit in the whole KV cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        assert 0 < request.num_tokens < self.config.max_model_len, request
        self._check_fits(request, request.num_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []

        # The loop below runs for every running request every step: it inlines the common
        # case (no new block needed, nothing in flight that ends the request).
        kv = self.kv_cache_manager
        block_size = kv.block_size
        max_model_len = self.config.max_model_len
        chunk = self.max_chunk
        running = self.running
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            in_flight = request.num_output_placeholders
            num_tokens = request.num_tokens
            num_new = num_tokens + in_flight - request.num_computed_tokens
            if num_new > chunk:
                num_new = chunk
            if num_new > budget:
                num_new = budget
            # With samples in flight that will reach max_tokens or max_model_len, the request
            # finishes when they arrive: scheduling another token would be wasted.
            if num_new <= 0 or (
                in_flight
                and (
                    len(request.output_token_ids) + in_flight >= request.max_tokens
                    or num_tokens + in_flight >= max_model_len
                )
            ):
                index += 1  # nothing to compute until a sample arrives, or nothing more ever
                continue
            end = request.num_computed_tokens + num_new
            if end > len(request.block_ids) * block_size:  # needs new blocks
                self._check_fits(request, end)
                while not kv.allocate_slots(request, num_new):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    break
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)

        if scheduled:
            self.num_steps += 1
        return self._make_output(scheduled, preempted)

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        """Move waiting requests to running in FIFO order; returns the budget left. A request
        whose grammar still compiles is passed over (it keeps its place in the queue)."""
        compiling: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.grammar is not None and not request.grammar.ready:
                compiling.append(self.waiting.popleft())
                continue
            hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, budget, self.max_chunk)
            self._check_fits(request, hit.num_tokens + num_new)
            if not self.kv_cache_manager.allocate_slots(request, num_new, hit):
                break
            request.num_computed_tokens = hit.num_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        return budget

    def _make_output(
        self, scheduled: list[tuple[Request, int]], preempted: list[str]
    ) -> SchedulerOutput:
        """The step as a diff against what the workers hold (see core/outputs.py), and the
        scheduler's own bookkeeping of it: progress advances now, samples become placeholders
        until `update_from_output` brings them."""
        new: list[NewRequestData] = []
        cached = CachedRequestData()
        cached_ids, cached_tokens = cached.request_ids, cached.new_token_ids
        cached_blocks, cached_computed = cached.new_block_ids, cached.num_computed_tokens
        in_flight: list[tuple[Request, bool, int]] = []
        num_scheduled: dict[str, int] = {}
        constrained: list[str] = []  # requests with a grammar that sample
        total = 0
        for request, num_new in scheduled:
            num_scheduled[request.request_id] = num_new
            total += num_new
            sent = request.num_sent_tokens
            num_tokens = request.num_tokens
            if sent is None:
                new.append(
                    NewRequestData(
                        request_id=request.request_id,
                        prompt_token_ids=list(request.prompt_token_ids),
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=list(request.block_ids),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            else:
                cached_ids.append(request.request_id)
                if sent == num_tokens:
                    cached_tokens.append([])
                elif sent + 1 == num_tokens and request.output_token_ids:  # one sample since
                    cached_tokens.append(request.output_token_ids[-1:])
                else:
                    cached_tokens.append(request.get_token_ids(sent, num_tokens))
                cached_blocks.append(request.block_ids[request.num_sent_blocks :])
                cached_computed.append(request.num_computed_tokens)
            request.num_sent_tokens = num_tokens
            request.num_sent_blocks = len(request.block_ids)
            computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = computed
            samples = computed >= num_tokens + request.num_output_placeholders
            if samples:
                request.num_output_placeholders += 1
                if request.grammar is not None:
                    constrained.append(request.request_id)
            in_flight.append((request, samples, computed))
        self._step_id += 1
        if in_flight:  # an empty step is never executed, so nothing would pop its entry
            self._in_flight[self._step_id] = in_flight
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            step_id=self._step_id,
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            structured_output_request_ids=constrained,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_sent_tokens = None  # the workers drop their copy
        request.num_sent_blocks = 0
        request.num_output_placeholders = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _check_fits(self, request: Request, num_tokens: int) -> None:
        """Raise instead of waiting forever for a request larger than the whole KV cache."""
        if not self.kv_cache_manager.can_fit(num_tokens):
            kv = self.kv_cache_manager
            raise RuntimeError(
                f"request {request.request_id!r} needs {kv.blocks_for_tokens(num_tokens)} KV "
                f"blocks for {num_tokens} tokens, but the whole cache has {kv.num_blocks} "
                f"blocks of {kv.block_size} tokens; lower max_model_len / max_tokens or give "
                f"the KV cache more memory"
            )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish and free stopped requests.

        Returns one plain record per request that received tokens this step, finished ones
        included (what reaches the caller is the front end's choice). Requests finished
        (aborted) since `schedule`, or whose id now names another request, are skipped. A
        request preempted since still gets its token (it is valid: computed from the whole
        sequence) and recomputes it with the rest when readmitted.
        """
        out = model_runner_output
        scheduled = self._in_flight.pop(scheduler_output.step_id, [])
        tokens, logprobs = _by_position(scheduled, out)
        prompt_lps = out.prompt_logprobs or {}
        kv = self.kv_cache_manager
        caching, block_size = kv.prefix_cache is not None, kv.block_size
        max_model_len = self.config.max_model_len
        requests = self.requests
        running = RequestStatus.RUNNING
        results: list[EngineCoreOutput] = []
        any_finished = False
        for (request, samples, computed), new_tokens, lp in zip(scheduled, tokens, logprobs):
            rid = request.request_id
            if requests.get(rid) is not request:
                continue  # finished (aborted) since schedule(), or an id reused since
            if (
                caching
                and request.status is running  # not preempted since
                and computed >= (len(request.cache_keys) + 1) * block_size
            ):
                kv.cache_full_blocks(request, computed)
            if rid in prompt_lps and request.prompt_logprobs is not None:
                start, entries = prompt_lps[rid]
                have = len(request.prompt_logprobs)  # positions recorded before (preemption)
                if start <= have:
                    request.prompt_logprobs.extend(entries[have - start :])
            if not new_tokens:
                if samples:
                    raise ValueError(f"request {rid!r} needed a sample but got none")
                continue
            if request.num_output_placeholders:  # zero once preempted
                request.num_output_placeholders -= 1
            appended, finished = new_tokens, False
            outputs, stop_set, max_tokens = (
                request.output_token_ids,
                request.stop_token_set,
                request.max_tokens,
            )
            for k, token_id in enumerate(new_tokens):
                outputs.append(token_id)  # (request.append_output_token, inlined)
                request.num_tokens += 1
                if (  # only then can _check_stop find a reason
                    token_id in stop_set
                    or len(outputs) >= max_tokens
                    or request.num_tokens >= max_model_len
                ):
                    status = self._check_stop(request, token_id)
                    if status is not None:
                        self._finish(request, status)
                        appended = new_tokens[: k + 1]
                        finished = any_finished = True
                        break
            if finished or lp is not None or request.prompt_logprobs is not None:
                results.append(
                    EngineCoreOutput(
                        rid,
                        appended,
                        request.finish_reason,
                        request.stop_reason,
                        None if lp is None else [lp],
                        _take_prompt_logprobs(request),
                        list(outputs) if finished else None,
                    )
                )
            else:  # the common record: a running request's new tokens
                results.append(EngineCoreOutput(rid, appended))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return results

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Stop tokens win over length limits when both hold on the same token."""
        num_output = request.num_output_tokens
        # (stop_token_set: the EOS ids unless ignore_eos, and the stop_token_ids)
        params = request.sampling_params
        if num_output >= params.min_tokens and token_id in request.stop_token_set:
            # As vLLM: an EOS token is a natural end (stop_reason None); one of the request's
            # stop_token_ids is named, so a client can tell the two apart.
            eos = not params.ignore_eos and token_id in request.eos_token_ids
            request.stop_reason = None if eos else token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.kv_cache_manager.free(request)
        request.status = status
        del self.requests[request.request_id]
        if request.num_sent_tokens is not None:
            self._finished_ids.append(request.request_id)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        found = [self.requests[i] for i in dict.fromkeys(ids) if i in self.requests]
        if not found:
            return
        for request in found:
            self._finish(request, status)
        self.running = [r for r in self.running if not r.is_finished]
        self.waiting = deque(r for r in self.waiting if not r.is_finished)


def _take_prompt_logprobs(request: Request) -> list | None:
    """A request's prompt logprobs for its first record (None first: the first prompt token
    has none), then None."""
    lps = request.prompt_logprobs
    if lps is None or request.prompt_logprobs_sent:
        return None
    request.prompt_logprobs_sent = True
    return [None, *lps]


def _by_position(
    scheduled: list[tuple[Request, bool, int]], out: ModelRunnerOutput
) -> tuple[list[list[int]], list[object | None]]:
    """The runner's tokens and logprobs lined up with `scheduled` (the step's batch order,
    which the runner's output follows; matched by id when it does not)."""
    ids, tokens = out.request_ids, out.sampled_token_ids
    if len(tokens) != len(ids):
        raise ValueError(f"{len(ids)} request ids but {len(tokens)} token lists")
    logprobs = out.logprobs if out.logprobs else [None] * len(ids)
    if ids == [r.request_id for r, _, _ in scheduled]:
        return tokens, logprobs
    index = {rid: k for k, rid in enumerate(ids)}
    found = [index.get(r.request_id) for r, _, _ in scheduled]
    return (
        [[] if k is None else tokens[k] for k in found],
        [None if k is None else logprobs[k] for k in found],
    )
