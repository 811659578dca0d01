"""A rank: owns its device, model shard, KV cache and ModelRunner. Workers never schedule.

At tensor_parallel_size 1 the worker lives in the engine's process; above, each lives in its
own process (executor/multiproc.py) or Ray actor (executor/ray_executor.py), which joins the
process group before building it."""

from __future__ import annotations

import torch

from llm_inference.config import EngineConfig
from llm_inference.core.outputs import SchedulerOutput
from llm_inference.distributed.parallel_state import get_custom_all_reduce
from llm_inference.executor.model_runner import ModelRunner
from llm_inference.executor.profiler import RankProfiler


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the CPU, or CUDA device (index of config.device, default 0) + r."""
    device = torch.device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, device: torch.device | None = None):
        """`device`: where Ray placed the rank (default: `worker_device`)."""
        self.rank = rank
        device = device or worker_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(config.seed)
        self.model_runner = ModelRunner(config, device)
        self.profiler = RankProfiler(rank, device)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def kv_bytes_per_block(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.model_runner.allocate_kv_cache(num_blocks, max_model_len)

    def uses_cuda_graphs(self) -> bool:
        return self.model_runner.graphs is not None

    def uses_custom_all_reduce(self) -> bool:
        return get_custom_all_reduce() is not None

    def uses_fused_all_reduce_norm(self) -> bool:
        custom = get_custom_all_reduce()
        return custom is not None and custom.fused_norm

    def execute_model(
        self, scheduler_output: SchedulerOutput, sync: bool = True, sample: bool = True
    ):
        """Launch the step. Rank 0: a PendingOutput (a worker process sends its result()
        once the tokens are on the host, while it goes on with the next call); other
        ranks: None. `sample=False`: the forward alone, None (`sample_tokens` follows)."""
        return self.model_runner.execute_model(scheduler_output, sync, sample)

    def sample_tokens(self, grammar_bitmask):
        """Sample the step launched with `sample=False`: as `execute_model` returns."""
        return self.model_runner.sample_tokens(grammar_bitmask)

    def grammar_bitmask_buffer(self, m: int, words: int):
        """Where a step's grammar bitmask may be filled in this process (ModelRunner's)."""
        return self.model_runner.grammar_bitmask_buffer(m, words)

    def gc_frozen_objects(self) -> int:
        """Objects in this process's permanent GC generation (gc_heap.py)."""
        import gc

        return gc.get_freeze_count()

    def start_profile(self, trace_dir: str | None = None) -> None:
        self.profiler.start(trace_dir)

    def stop_profile(self) -> dict:
        return self.profiler.stop()

    def shutdown(self) -> None:
        self.model_runner.release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
