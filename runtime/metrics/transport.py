"""Moving snapshot JSON from every rank to rank 0: never a collective, never in the decode step.

    MetricsPublisher.publish(blob)   each rank, from its publisher thread: overwrite its latest
    MetricsReader.read()             rank 0's dashboard thread: {rank: latest blob} for the ranks
                                     that have published; a rank not there yet is simply absent

Backends:
    StorePublisher / StoreReader   the torch.distributed key-value store every job already has
                                   (the default process group's TCPStore, or one handed in); one
                                   key per rank, ``zerodram/metrics/<rank>``, overwritten in place.
    InProcessBus                   a locked dict, for tests and single-process tools.

Store facts this relies on (torch 2.8 - 2.13): `set` overwrites; `get` and `multi_get` block up to
the store's timeout on a missing key, so the reader first asks `check([key])` (non-blocking, True
once the key exists) and only then reads; a key, once set, is never deleted here, so a rank seen
once is read with one `multi_get` round trip per refresh from then on. Where the store offers
`clone()`, the reader and publisher use their own connection with a short timeout, so that neither
waits behind (nor changes the timeout of) the process group's own store traffic.
"""

from __future__ import annotations

import datetime
import threading
from abc import ABC, abstractmethod
from typing import Any

METRICS_KEY_PREFIX = "zerodram/metrics/"


def metrics_key(rank: int, prefix: str = METRICS_KEY_PREFIX) -> str:
    """The store key holding `rank`'s latest snapshot."""
    return f"{prefix}{rank}"


class MetricsPublisher(ABC):
    """Sends this rank's latest snapshot JSON. `publish` may block briefly (a store round trip):
    call it from a background thread, never the decode step."""

    @abstractmethod
    def publish(self, blob: str) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection. Idempotent."""


class MetricsReader(ABC):
    """Reads the latest snapshot JSON of every rank that has published."""

    world_size: int

    @abstractmethod
    def read(self) -> dict[int, str]:
        """{rank: blob} for ranks that have published; raises on a broken transport."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection. Idempotent."""


def _own_connection(store: Any, timeout_s: float) -> Any:
    clone = getattr(store, "clone", None)
    if clone is None:
        return store  # older torch: share the connection and leave its timeout alone
    own = clone()
    own.set_timeout(datetime.timedelta(seconds=timeout_s))
    return own


def default_store() -> Any:
    """The default process group's key-value store (a PrefixStore over the job's TCPStore).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except ValueError as err:
        raise RuntimeError(f"no default store: {err}") from None


class StorePublisher(MetricsPublisher):
    """Publishes into a torch.distributed Store under ``zerodram/metrics/<rank>``.

    Args:
        rank: the publishing rank.
        store: a `torch.distributed.Store`; default: the default process group's.
        timeout_s: bound on one publish (on the publisher's own connection, where possible).
        prefix: key prefix; publishers and reader of one dashboard must agree on it.
    """

    def __init__(
        self, rank: int, store: Any = None, *, timeout_s: float = 5.0, prefix: str = METRICS_KEY_PREFIX
    ) -> None:
        self.rank = rank
        self._key = metrics_key(rank, prefix)
        self._store = _own_connection(store if store is not None else default_store(), timeout_s)

    def publish(self, blob: str) -> None:
        self._store.set(self._key, blob)


class StoreReader(MetricsReader):
    """Reads every rank's key from a torch.distributed Store without blocking on absent ranks.

    Args:
        world_size: ranks to look for (0 .. world_size-1).
        store: a `torch.distributed.Store`; default: the default process group's.
        timeout_s: bound on one store operation (on the reader's own connection, where possible).
        prefix: key prefix, as given to the publishers.
    """

    def __init__(
        self, world_size: int, store: Any = None, *, timeout_s: float = 2.0, prefix: str = METRICS_KEY_PREFIX
    ) -> None:
        self.world_size = world_size
        self._prefix = prefix
        self._store = _own_connection(store if store is not None else default_store(), timeout_s)
        self._known: list[int] = []
        self._multi_get = getattr(self._store, "multi_get", None)

    def read(self) -> dict[int, str]:
        known = set(self._known)
        for rank in range(self.world_size):
            if rank not in known and self._store.check([metrics_key(rank, self._prefix)]):
                self._known.append(rank)
        self._known.sort()
        if not self._known:
            return {}
        keys = [metrics_key(r, self._prefix) for r in self._known]
        get_all = self._multi_get or (lambda ks: [self._store.get(k) for k in ks])
        blobs = get_all(keys)
        return {r: b.decode() if isinstance(b, bytes) else b for r, b in zip(self._known, blobs, strict=True)}


class InProcessBus:
    """A transport inside one process: `publisher(rank)` and `reader()` share a locked dict."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._blobs: dict[int, str] = {}
        self._lock = threading.Lock()

    def publisher(self, rank: int) -> MetricsPublisher:
        return _BusPublisher(self, rank)

    def reader(self) -> MetricsReader:
        return _BusReader(self)


class _BusPublisher(MetricsPublisher):
    def __init__(self, bus: InProcessBus, rank: int) -> None:
        self._bus, self.rank = bus, rank

    def publish(self, blob: str) -> None:
        with self._bus._lock:
            self._bus._blobs[self.rank] = blob


class _BusReader(MetricsReader):
    def __init__(self, bus: InProcessBus) -> None:
        self._bus, self.world_size = bus, bus.world_size

    def read(self) -> dict[int, str]:
        with self._bus._lock:
            return dict(self._bus._blobs)
