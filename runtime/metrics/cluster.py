"""Rank 0's view of the whole job: the latest snapshot of every rank, each marked fresh or stale.

`ClusterSampler.sample()` reads the transport once and returns a frozen `ClusterSnapshot`. A rank
is *stale* when its `seq` has not changed for `stale_after_s` seconds of rank 0's monotonic clock
(never by comparing wall clocks of different hosts), or when it has never published ("missing").
A transport failure makes every rank stale for that sample; it never raises into the caller.
The last sample of a failing job (`sample(failed=True)`) calls a rank that has not published its
"stopped" snapshot *unknown*: its last numbers may be fresh, yet it may have died since.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from zerodram.runtime.metrics.snapshot import RankSnapshot
from zerodram.runtime.metrics.transport import MetricsReader

RANK_STATUSES = ("ok", "stale", "missing", "stopped", "unknown")


@dataclass(frozen=True)
class RankStatus:
    """One rank as rank 0 sees it. `snapshot` is the latest one received (None if none yet);
    `age_s` is how long ago its `seq` last changed (None if never seen)."""

    rank: int
    status: str  # one of RANK_STATUSES
    snapshot: RankSnapshot | None
    age_s: float | None


@dataclass(frozen=True)
class ClusterSnapshot:
    """Every rank's status at one instant, index == rank. `error` names a transport failure."""

    ranks: tuple[RankStatus, ...]
    time_s: float
    error: str | None = None

    @classmethod
    def from_snapshots(
        cls, snapshots: Mapping[int, RankSnapshot], world_size: int, *, stale: tuple[int, ...] = ()
    ) -> ClusterSnapshot:
        """Build one directly (tests, offline tools): ranks absent from `snapshots` are missing."""
        ranks = []
        for r in range(world_size):
            snap = snapshots.get(r)
            if snap is None:
                ranks.append(RankStatus(r, "missing", None, None))
            else:
                status = "stale" if r in stale else ("stopped" if snap.state == "stopped" else "ok")
                ranks.append(RankStatus(r, status, snap, 0.0))
        return cls(tuple(ranks), time.time())

    @property
    def live(self) -> tuple[RankSnapshot, ...]:
        """Snapshots of ranks that are ok (fresh and running)."""
        return tuple(r.snapshot for r in self.ranks if r.status == "ok" and r.snapshot is not None)

    @property
    def tokens_per_s(self) -> float:
        """Cluster throughput: the sum over fresh ranks."""
        return sum(s.tokens_per_s for s in self.live)

    def expert_totals(self, num_experts: int) -> list[int]:
        """Tokens per expert over the recent window, summed over fresh ranks, ``[E]``."""
        out = [0] * num_experts
        for s in self.live:
            for e, c in zip(s.expert_idx, s.expert_counts, strict=True):
                if e < num_experts:
                    out[e] += c
        return out


class ClusterSampler:
    """Reads a `MetricsReader` and tracks freshness per rank.

    Args:
        reader: the transport's reading end.
        world_size: ranks expected.
        stale_after_s: seconds without a new `seq` before a rank is shown stale.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        reader: MetricsReader,
        world_size: int,
        *,
        stale_after_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reader = reader
        self.world_size = world_size
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._latest: dict[int, RankSnapshot] = {}
        self._changed_at: dict[int, float] = {}

    def sample(self, *, failed: bool = False) -> ClusterSnapshot:
        """Read every rank once; never raises for transport or decoding failures.

        Args:
            failed: the job is failing (the last sample): a rank seen but not "stopped" is
                "unknown" rather than judged by the age of its snapshot.
        """
        now = self._clock()
        error = None
        transport_failed = False
        try:
            blobs = self.reader.read()
        except Exception as err:  # a dead store must not take the dashboard down with it
            blobs, error, transport_failed = {}, _first_line(err), True
        for rank, blob in blobs.items():
            try:
                snap = RankSnapshot.from_json(blob)
            except ValueError as err:
                error = f"rank {rank}: {err}"
                continue
            prev = self._latest.get(rank)
            if prev is None or prev.seq != snap.seq:
                self._changed_at[rank] = now
            self._latest[rank] = snap
        ranks = []
        for r in range(self.world_size):
            snap = self._latest.get(r)
            if snap is None:
                ranks.append(RankStatus(r, "missing", None, None))
                continue
            age = now - self._changed_at[r]
            if snap.state == "stopped":
                status = "stopped"
            elif failed:
                status = "unknown"
            elif age > self.stale_after_s or transport_failed:
                status = "stale"
            else:
                status = "ok"
            ranks.append(RankStatus(r, status, snap, age))
        return ClusterSnapshot(tuple(ranks), time.time(), error)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
