"""Scheduling and KV block bookkeeping: pure Python, never imports torch."""

from llm_inference.core.block_pool import BlockPool, KVCacheBlock, NoFreeBlocksError
from llm_inference.core.kv_cache_manager import KVCacheManager, slot_for_position, slot_mapping
from llm_inference.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from llm_inference.core.request import Request, RequestStatus
from llm_inference.core.scheduler import Scheduler

__all__ = [
    "BlockPool",
    "CachedRequestData",
    "EngineCoreOutput",
    "KVCacheBlock",
    "KVCacheManager",
    "ModelRunnerOutput",
    "NewRequestData",
    "NoFreeBlocksError",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "slot_for_position",
    "slot_mapping",
]
