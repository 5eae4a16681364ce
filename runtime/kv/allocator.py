"""Page allocator and per-sequence block tables of a paged KV cache."""

from __future__ import annotations

from zerodram.runtime.kv.errors import KVCapacityError, KVInputError


class PageAllocator:
    """A free list of `num_pages` page indices. Pages are handed out lowest index first."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise KVInputError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() gives the lowest index

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n pages.

        Raises:
            KVCapacityError: fewer than n pages are free (nothing is taken).
        """
        if n > len(self._free):
            raise KVCapacityError(f"page pool exhausted: {n} pages needed, {len(self._free)} of {self.num_pages} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        """Return pages to the pool (double frees raise KVInputError)."""
        free = set(self._free)
        for p in pages:
            if p in free or not 0 <= p < self.num_pages:
                raise KVInputError(f"page {p} is not allocated")
            free.add(p)
        self._free = sorted(free, reverse=True)


class BlockTables:
    """Sequence slots: for each, the list of its pages in order and its length in tokens."""

    def __init__(self, max_seqs: int, max_pages_per_seq: int) -> None:
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def open(self) -> int:
        """A free slot id.

        Raises:
            KVCapacityError: all `max_seqs` slots are in use.
        """
        for sid in range(self.max_seqs):
            if sid not in self.pages:
                self.pages[sid] = []
                self.lens[sid] = 0
                return sid
        raise KVCapacityError(f"all {self.max_seqs} sequence slots are in use")

    def check(self, seq_id: int) -> None:
        if seq_id not in self.pages:
            raise KVInputError(f"unknown sequence {seq_id} (open: {sorted(self.pages)})")

    def close(self, seq_id: int) -> list[int]:
        """Forget a sequence; returns its pages for the allocator."""
        self.check(seq_id)
        self.lens.pop(seq_id)
        return self.pages.pop(seq_id)
