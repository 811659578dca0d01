"""A rank: owns its device, model shard, KV cache and ModelRunner. Workers never schedule."""

from __future__ import annotations

import torch

from llm_inference.config import EngineConfig
from llm_inference.core.outputs import SchedulerOutput
from llm_inference.executor.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.rank = rank
        device = torch.device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank if device.index is None else device.index)
            torch.cuda.set_device(device)
        torch.manual_seed(config.seed)
        self.model_runner = ModelRunner(config, device)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def kv_bytes_per_block(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.allocate_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput, sync: bool = True):
        return self.model_runner.execute_model(scheduler_output, sync)

    def shutdown(self) -> None:
        self.model_runner.release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
