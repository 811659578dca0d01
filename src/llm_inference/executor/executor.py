"""Executor: one interface over the ranks, `collective_rpc(method, *args)`.

For tensor_parallel_size 1 the single worker lives in this process (no extra overhead); above,
each rank is a worker process (executor/multiproc.py) and the calls go over pipes, pipelined:
a step can be sent before the previous one's replies are read (async scheduling). With
`distributed_executor_backend="ray"` every rank, even a single one, is a Ray actor
(executor/ray_executor.py), placed anywhere in the Ray cluster."""

from __future__ import annotations

from typing import Any

from llm_inference.config import EngineConfig
from llm_inference.core.outputs import ModelRunnerOutput, SchedulerOutput
from llm_inference.executor.pending import PendingOutput
from llm_inference.executor.worker import Worker


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        self.workers: list[Worker] = []
        self.processes = None  # MultiprocWorkers or RayWorkers: the ranks elsewhere
        self._forward = None  # the call of a step sent with sample=False, until sampled
        if config.parallel.distributed_executor_backend == "ray":
            from llm_inference.executor.ray_executor import RayWorkers

            self.processes = RayWorkers(config)
        elif self.world_size == 1:
            self.workers = [Worker(config, rank=0)]
        else:
            from llm_inference.executor.multiproc import MultiprocWorkers

            self.processes = MultiprocWorkers(config)

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids (empty when the single worker is in this process)."""
        return [] if self.processes is None else list(self.processes.pids)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self.processes is not None:
            return self.processes.collective_rpc(method, *args)
        return [getattr(w, method)(*args) for w in self.workers]

    def execute_model(
        self, scheduler_output: SchedulerOutput, sync: bool = True, sample: bool = True
    ):
        """Launch a step on every rank; a handle whose `.result()` waits for rank 0's
        ModelRunnerOutput. With worker processes, `sync=False` returns once the step is sent
        (its replies are read by `result()`, after those of the calls sent before it), so the
        next step can be scheduled and sent while the workers run this one. `sample=False`
        launches the forward alone and returns None: `sample_tokens` samples it."""
        if self.processes is not None:
            call = self.processes.submit("execute_model", scheduler_output, sync, sample)
            if not sample:
                self._forward = call
                return None
            return PendingOutput.done(call.result()[0]) if sync else _RankZero(call)
        out = self.collective_rpc("execute_model", scheduler_output, sync, sample)[0]
        return PendingOutput.done(out) if isinstance(out, ModelRunnerOutput) else out

    def sample_tokens(self, grammar_bitmask):
        """Sample the step `execute_model(sample=False)` launched, on every rank, with the
        step's grammar bitmask: a handle as `execute_model(sync=False)` returns."""
        if self.processes is not None:
            forward, self._forward = self._forward, None
            return _RankZero(self.processes.submit("sample_tokens", grammar_bitmask), forward)
        return self.collective_rpc("sample_tokens", grammar_bitmask)[0]

    def grammar_bitmask_buffer(self, m: int, words: int):
        """[m, words] int32 where the single worker in this process sends a step's grammar
        bitmask from, for the engine core to fill in place; None where the ranks are elsewhere
        (the bitmask is sent to them: any array serves)."""
        if self.processes is not None:
            return None
        return self.workers[0].grammar_bitmask_buffer(m, words)

    def shutdown(self) -> None:
        if self.processes is not None:
            self.processes.shutdown()
        else:
            self.collective_rpc("shutdown")
        self.workers = []


class _RankZero:
    """A step sent to the worker processes; `result()`: rank 0's ModelRunnerOutput. A step
    sampled apart also holds its forward's call, whose error, if any, is the one to raise
    (a Ray rank runs `sample_tokens` even after its forward raised)."""

    def __init__(self, call, forward=None) -> None:
        self._call, self._forward = call, forward

    def result(self) -> ModelRunnerOutput:
        if self._forward is not None:
            self._forward.result()
        return self._call.result()[0]
