"""The per-rank publisher thread: snapshot the collector a few times a second and publish it.

    agent = MetricsAgent(collector, StorePublisher(ctx.rank)).start()
    ...serve...
    agent.stop()        # publishes a final "stopped" snapshot; idempotent

The thread is a daemon and swallows its own failures (logged once), so metrics can never stop
or slow the engine beyond the GIL time of building a small snapshot.
"""

from __future__ import annotations

import logging
import threading

from zerodram.runtime.metrics.collector import MetricsCollector
from zerodram.runtime.metrics.transport import MetricsPublisher

log = logging.getLogger("zerodram.metrics")

# Snapshots are capped at a few per second: each costs a store round trip and ~1 ms of GIL.
MIN_PERIOD_S = 0.1


class MetricsAgent:
    """Publishes `collector.snapshot()` every `period_s` seconds from a background thread.

    Args:
        collector: the rank's `MetricsCollector`.
        publisher: where snapshots go (`StorePublisher`, or an `InProcessBus` publisher).
        period_s: seconds between snapshots (at least 0.1).
    """

    def __init__(
        self, collector: MetricsCollector, publisher: MetricsPublisher, period_s: float = 0.25
    ) -> None:
        self.collector = collector
        self.publisher = publisher
        self.period_s = max(period_s, MIN_PERIOD_S)
        self.num_published = 0
        self.num_failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> MetricsAgent:
        """Start the thread (once); returns self."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(
                target=self._run, name=f"zerodram-metrics-r{self.collector.rank}", daemon=True
            )
            self._thread.start()
        return self

    def publish_now(self, state: str = "running") -> bool:
        """Build and publish one snapshot in the calling thread; False (logged once) on failure."""
        try:
            self.publisher.publish(self.collector.snapshot(state).to_json())
        except Exception:
            self.num_failed += 1
            if self.num_failed == 1:
                log.exception("rank %d: publishing metrics failed (not logged again)", self.collector.rank)
            return False
        self.num_published += 1
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.publish_now()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and publish a last snapshot marked "stopped". Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.publish_now("stopped")
        self.publisher.close()
