"""LLMEngine: add_request / step / abort. One step is schedule -> execute -> update."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from llm_inference.config import EngineConfig
from llm_inference.core.request import Request, RequestStatus
from llm_inference.core.scheduler import Scheduler
from llm_inference.engine.detokenizer import IncrementalDetokenizer
from llm_inference.executor.executor import Executor
from llm_inference.sampling_params import SamplingParams


class KVCacheTooSmallError(ValueError):
    pass


@dataclass
class RequestState:
    """Engine-side state of one request: the scheduler's Request plus text and logprobs."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list = field(default_factory=list)
    num_detokenized: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.executor = Executor(config)
        num_blocks = min(self.executor.collective_rpc("determine_num_blocks"))
        self._check_cache_fits(num_blocks)
        self.executor.collective_rpc("allocate_kv_cache", num_blocks)
        self.scheduler = Scheduler(config.scheduler, num_blocks, config.cache.block_size)
        self.states: dict[str, RequestState] = {}
        self.rng = random.Random(config.seed)

    def _check_cache_fits(self, num_blocks: int) -> None:
        block_size = self.config.cache.block_size
        max_len = self.config.scheduler.max_model_len
        need = -(-max_len // block_size)
        if num_blocks < need:
            per_block = self.executor.collective_rpc("kv_bytes_per_block")[0]
            raise KVCacheTooSmallError(
                f"KV cache too small for one request of max_model_len={max_len} tokens: it "
                f"needs {need} blocks of {block_size} tokens ({need * per_block:,} bytes) but "
                f"only {num_blocks} blocks ({num_blocks * per_block:,} bytes) fit; raise "
                "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if params.seed is None:
            # Every request gets a seed: its random stream never depends on its batch companions.
            params = replace(params, seed=self.rng.getrandbits(63))
        max_len = self.config.scheduler.max_model_len
        max_tokens = params.max_tokens or max_len - len(prompt_token_ids)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.config.model.eos_token_ids,
            max_tokens=max_tokens,
        )
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        self.states[request_id] = RequestState(request, detok)
        self.scheduler.add_request(request)

    def step(self) -> list[RequestState]:
        """Run one step; return the states of requests that finished in it."""
        so = self.scheduler.schedule()
        if so.is_empty:
            return []
        out = self.executor.execute_model(so)
        updated = self.scheduler.update_from_output(so, out)
        if out.logprobs is not None:
            for rid, lp in zip(out.request_ids, out.logprobs):
                if lp is not None:
                    self.states[rid].logprobs.append(lp)
        finished = []
        for request in updated:
            state = self.states[request.request_id]
            new = request.output_token_ids[state.num_detokenized :]
            state.num_detokenized = len(request.output_token_ids)
            stop = state.detokenizer.add_tokens(new)
            if stop is not None:
                # A stop string ends the request even if a length limit ended it too.
                if not request.is_finished:
                    self.scheduler.finish_requests(
                        request.request_id, RequestStatus.FINISHED_STOPPED
                    )
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop
            if request.is_finished:
                finished.append(self.states.pop(request.request_id))
        return finished

    def abort_request(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in request_ids:
            self.states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> dict[str, int]:
        kv = self.scheduler.kv_cache_manager
        return {
            "num_kv_blocks": kv.num_blocks,
            "num_free_kv_blocks": kv.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.scheduler.num_steps,
            "num_unfinished_requests": self.scheduler.get_num_unfinished_requests(),
        }

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
