"""Metrics: every rank measures itself, rank 0 sees them all (drawn by `launch/dashboard.py`).

    collector   MetricsCollector   what the engine records into (timings, tokens, KV, experts, ...)
    timer       StepTimer          per-phase step timings (CUDA events / perf_counter)
    kv_quality  KvQualitySampler   sampled relative errors of the quantized KV cache, per layer
    snapshot    RankSnapshot       a frozen, JSON-serialisable picture of one rank
    transport   MetricsPublisher / MetricsReader: the key-value store, or in-process for tests
    agent       MetricsAgent       per-rank thread publishing snapshots a few times a second
    cluster     ClusterSampler     rank 0: every rank's latest snapshot, fresh or stale

The engine imports this package; it never imports the dashboard. Reference: docs/dashboard.md.
"""

from zerodram.runtime.metrics.agent import MetricsAgent
from zerodram.runtime.metrics.cluster import ClusterSampler, ClusterSnapshot, RankStatus
from zerodram.runtime.metrics.collector import MetricsCollector
from zerodram.runtime.metrics.kv_quality import KvQualitySampler
from zerodram.runtime.metrics.snapshot import (
    PHASES,
    KvQualityLayer,
    KvStats,
    PhaseStats,
    RankSnapshot,
    WarningRecord,
)
from zerodram.runtime.metrics.timer import CpuStepTimer, CudaStepTimer, StepTimer, StepTiming, make_step_timer
from zerodram.runtime.metrics.transport import (
    InProcessBus,
    MetricsPublisher,
    MetricsReader,
    StorePublisher,
    StoreReader,
    metrics_key,
)

__all__ = [
    "PHASES",
    "ClusterSampler",
    "ClusterSnapshot",
    "CpuStepTimer",
    "CudaStepTimer",
    "InProcessBus",
    "KvQualityLayer",
    "KvQualitySampler",
    "KvStats",
    "MetricsAgent",
    "MetricsCollector",
    "MetricsPublisher",
    "MetricsReader",
    "PhaseStats",
    "RankSnapshot",
    "RankStatus",
    "StepTimer",
    "StepTiming",
    "StorePublisher",
    "StoreReader",
    "WarningRecord",
    "make_step_timer",
    "metrics_key",
]
