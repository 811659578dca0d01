"""Executor: one interface over the ranks, `collective_rpc(method, *args)`.

For tensor_parallel_size 1 the single worker lives in this process."""

from __future__ import annotations

from typing import Any

from llm_inference.config import EngineConfig
from llm_inference.core.outputs import SchedulerOutput
from llm_inference.executor.worker import Worker


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={config.parallel.tensor_parallel_size} is not supported "
                "yet: only 1"
            )
        self.workers = [Worker(config, rank=0)]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(w, method)(*args) for w in self.workers]

    def execute_model(self, scheduler_output: SchedulerOutput, sync: bool = True):
        """Launch a step on every rank; rank 0's PendingOutput (`.result()` waits)."""
        return self.collective_rpc("execute_model", scheduler_output, sync)[0]

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")
        self.workers = []
