"""The scheduler core: a pure state machine (no sockets, threads or clocks).

`Scheduler.schedule() -> StepPlan` and `Scheduler.update(plan, result) -> list[RequestOutput]`;
the adapter in services/scheduler/server.py owns all I/O."""
from services.scheduler.core.block_pool import BlockPool
from services.scheduler.core.kv_cache_manager import KVCacheManager, chained_block_hash
from services.scheduler.core.request import FinishReason, Request, RequestStatus
from services.scheduler.core.scheduler import Scheduler, SchedulerConfig
from services.scheduler.core.types import (CachedRequestPlan, NewRequestPlan, RequestOutput, SampledTokens,
                                           StepPlan, StepResult)

__all__ = ["BlockPool", "KVCacheManager", "chained_block_hash", "CachedRequestPlan", "FinishReason", "NewRequestPlan", "Request", "RequestOutput",
           "RequestStatus", "SampledTokens", "Scheduler", "SchedulerConfig", "StepPlan", "StepResult"]
