"""The serving engine: requests, continuous-batching scheduler, sampler, lockstep step loop, jobs.

from zerodram.runtime.engine import Engine, EngineConfig, SamplingParams, build_engine
"""

from zerodram.runtime.engine.config import EngineConfig, StepStats
from zerodram.runtime.engine.engine import Engine
from zerodram.runtime.engine.request import RequestOutput, SamplingParams, TokenEvent
from zerodram.runtime.engine.scheduler import SchedulerConfig

__all__ = [
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StepStats",
    "TokenEvent",
]
