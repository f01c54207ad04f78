"""pdserve's engine: model loading, paged KV cache, continuous-batching scheduler, sampler.

Prefill workers, decode workers and the colocated mode all run :class:`LLMEngine`.
"""

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "SamplingParams",
    "SchedulerConfig",
    "TokenEvent",
]
