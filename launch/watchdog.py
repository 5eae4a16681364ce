"""A host-side bound on each stage of a long run: "fail loudly, never hang" where the waits have no
timeout of their own (NVSHMEM init, `barrier_all`, symmetric allocation are host collectives that
wait forever on a peer that never joins).

    dog = StageWatchdog("rank 2/4")
    dog.stage("NVSHMEM init", limit_s=300)     # each call restarts the clock for a new stage
    ...
    dog.close()

A stage past its limit prints who was where and every thread's stack to stderr, then ends the
process (`os._exit`: a clean shutdown would run collective teardown and wait on the same peer);
under torchrun the agent then stops the other ranks.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_CODE = 4


class StageWatchdog:
    """A daemon thread that checks the current stage's deadline twice a second.

    Args:
        who: how the report names this process ("rank 2/4").
        poll_s: how often the deadline is checked.
    """

    def __init__(self, who: str, poll_s: float = 0.5) -> None:
        self.who, self._poll_s = who, poll_s
        self._stage = ("start", 0.0, float("inf"))  # what, limit_s, deadline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stage-watchdog", daemon=True)
        self._thread.start()

    def stage(self, what: str, limit_s: float) -> None:
        """Enter stage `what`, which must end (by the next `stage` call) within `limit_s` seconds."""
        # one tuple, swapped whole: the watcher never reports one stage with another's deadline
        self._stage = (what, limit_s, time.monotonic() + limit_s)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            what, limit, deadline = self._stage
            if time.monotonic() > deadline:
                try:
                    print(
                        f"{self.who}: no progress for {limit:g}s in {what}; stacks follow, then exit",
                        file=sys.stderr,
                        flush=True,
                    )
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                finally:  # a closed or captured stderr must not spare a stuck process
                    os._exit(EXIT_CODE)

    def close(self) -> None:
        """Stop watching. Idempotent."""
        self._stop.set()
