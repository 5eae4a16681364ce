"""What one rank tells rank 0: a frozen `RankSnapshot`, serialised as one small JSON object.

A rank builds a snapshot a few times a second (never in the decode step) and publishes the JSON
through a `MetricsPublisher`; rank 0 decodes it with `RankSnapshot.from_json`. Every field is a
plain number, string or tuple so that the JSON stays small (~1-3 KB for 256 experts) and the
dashboard is a pure function of snapshots.

Units: times in milliseconds (`*_ms`), rates per second (`*_per_s`), sizes in bytes (`*_bytes`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SNAPSHOT_VERSION = 1
# The phases of one decode step, in execution order (stages 3-7 of docs/architecture.md).
# "dispatch" covers router + dispatch; "total" is the whole step, begin to end.
PHASES = ("attention", "dispatch", "experts", "combine", "sampling")
RANK_STATES = ("running", "stopped")


@dataclass(frozen=True)
class PhaseStats:
    """Latency of one phase over the recent window of timed steps (summed over layers)."""

    name: str
    p50_ms: float
    p99_ms: float
    mean_ms: float
    num_samples: int


@dataclass(frozen=True)
class KvStats:
    """This rank's KV partition. `bf16_bytes` is what the same tokens would take in BF16."""

    num_pages_used: int = 0
    num_pages_free: int = 0
    used_bytes: int = 0
    bf16_bytes: int = 0

    @property
    def num_pages(self) -> int:
        return self.num_pages_used + self.num_pages_free

    @property
    def occupancy(self) -> float:
        """Fraction of pages in use, 0..1 (0 when the partition is empty)."""
        return self.num_pages_used / self.num_pages if self.num_pages else 0.0

    @property
    def saved_bytes(self) -> int:
        """Bytes saved against BF16 for the pages in use."""
        return max(self.bf16_bytes - self.used_bytes, 0)


@dataclass(frozen=True)
class KvQualityLayer:
    """Relative errors of sampled, freshly written K/V blocks of one layer (quantized vs full
    precision): ||deq - fp|| / ||fp||, averaged over the recent samples. `score_rel_err` is the
    same for the query-key scores q·kᵀ, None when no query was sampled."""

    layer_idx: int
    k_rel_err: float
    v_rel_err: float
    score_rel_err: float | None
    num_samples: int


@dataclass(frozen=True)
class WarningRecord:
    """One recent warning or error. `time_s` is the rank's wall clock (time.time())."""

    time_s: float
    level: str  # "warning" | "error" | "timeout"
    message: str


@dataclass(frozen=True)
class RankSnapshot:
    """Everything rank 0 shows about one rank, at one instant.

    Attributes:
        rank: the publishing rank.
        seq: increases by one per publish; rank 0 calls a rank stale when seq stops changing.
        time_s: the rank's wall clock at build time (informational: clocks of hosts differ).
        uptime_s: seconds since the rank's collector started.
        state: "running", or "stopped" once the rank shut its metrics down cleanly.
        device: "cpu" or "cuda:N".
        num_steps: decode steps ended so far.
        num_tokens: tokens produced so far.
        tokens_per_s: tokens per second over the recent window.
        phases: `PhaseStats` for each of PHASES plus "total".
        num_running, num_queued: requests being decoded / waiting.
        kv: the KV partition.
        expert_idx: the experts `expert_counts` refer to (global indices, ascending).
        expert_counts: tokens routed from this rank to each expert over the recent window.
        send_bytes_per_s: dispatch bytes per second sent to each peer rank, ``[world_size]``.
        kv_quality: one `KvQualityLayer` per sampled layer.
        num_warnings, num_errors, num_timeouts: counts since start.
        recent_warnings: the last few warnings, oldest first.
    """

    rank: int
    seq: int
    time_s: float
    uptime_s: float
    state: str = "running"
    device: str = "cpu"
    num_steps: int = 0
    num_tokens: int = 0
    tokens_per_s: float = 0.0
    phases: tuple[PhaseStats, ...] = ()
    num_running: int = 0
    num_queued: int = 0
    kv: KvStats = field(default_factory=KvStats)
    expert_idx: tuple[int, ...] = ()
    expert_counts: tuple[int, ...] = ()
    send_bytes_per_s: tuple[float, ...] = ()
    kv_quality: tuple[KvQualityLayer, ...] = ()
    num_warnings: int = 0
    num_errors: int = 0
    num_timeouts: int = 0
    recent_warnings: tuple[WarningRecord, ...] = ()

    def phase(self, name: str) -> PhaseStats | None:
        """The stats of phase `name` ("total" for the whole step), None if never timed."""
        for p in self.phases:
            if p.name == name:
                return p
        return None

    @property
    def expert_imbalance(self) -> float:
        """max / mean of `expert_counts` (1.0 = perfectly even; 0.0 when nothing was routed)."""
        total = sum(self.expert_counts)
        if not total:
            return 0.0
        return max(self.expert_counts) * len(self.expert_counts) / total

    def to_json(self) -> str:
        """Compact JSON (no spaces); `from_json` inverts it exactly."""
        data = asdict(self)
        data["v"] = SNAPSHOT_VERSION
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, blob: str | bytes) -> RankSnapshot:
        """Decode a snapshot.

        Raises:
            ValueError: not JSON, another snapshot version, or fields missing / of the wrong kind.
        """
        try:
            data: dict[str, Any] = json.loads(blob)
            version = data.pop("v", None)
            if version != SNAPSHOT_VERSION:
                raise ValueError(f"snapshot version {version}, this build reads {SNAPSHOT_VERSION}")
            return cls(
                **{
                    **data,
                    "phases": tuple(PhaseStats(**p) for p in data.get("phases", ())),
                    "kv": KvStats(**data.get("kv", {})),
                    "expert_idx": tuple(data.get("expert_idx", ())),
                    "expert_counts": tuple(data.get("expert_counts", ())),
                    "send_bytes_per_s": tuple(data.get("send_bytes_per_s", ())),
                    "kv_quality": tuple(KvQualityLayer(**q) for q in data.get("kv_quality", ())),
                    "recent_warnings": tuple(WarningRecord(**w) for w in data.get("recent_warnings", ())),
                }
            )
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a rank snapshot: {err}") from None
