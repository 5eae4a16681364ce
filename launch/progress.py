"""Progress for `zerodram bench ...` sweeps: a rich bar on a terminal, plain lines otherwise.

    with progress_bar(len(cases), "bench dispatch") as bar:
        for case in cases:
            run(case)
            bar.advance(note=case.name)

Only rank 0 should show progress (other ranks pass `enabled=False`, which makes every call a no-op).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressHandle:
    """What `progress_bar` yields: `advance(n, note)` moves the bar by `n` items."""

    def __init__(self, total: int, description: str, console: Console, live: Progress | None) -> None:
        self.total, self.description, self.done = total, description, 0
        self._console, self._live = console, live
        self._task = live.add_task(description, total=total) if live is not None else None
        self._t0 = time.monotonic()
        self._next_pct = 0

    def advance(self, n: int = 1, note: str | None = None) -> None:
        """Count `n` more items done; `note` names the latest (shown next to the bar)."""
        self.done += n
        if self._live is not None:
            desc = f"{self.description} [dim]{note}[/]" if note else self.description
            self._live.update(self._task, advance=n, description=desc)
            return
        # Plain: one line per ~10% (and the last), so logs stay short for long sweeps.
        pct = 100 * self.done // max(self.total, 1)
        if pct >= self._next_pct or self.done >= self.total:
            self._next_pct = (pct // 10 + 1) * 10
            elapsed = time.monotonic() - self._t0
            tail = f" ({note})" if note else ""
            line = f"{self.description}: {self.done}/{self.total} ({pct}%) {elapsed:.1f}s{tail}"
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)


class _NoProgress(ProgressHandle):
    def __init__(self) -> None:
        self.total = self.done = 0

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.done += n


@contextmanager
def progress_bar(
    total: int, description: str, *, console: Console | None = None, enabled: bool = True
) -> Iterator[ProgressHandle]:
    """A progress display for `total` items: rich Progress on a terminal (not TERM=dumb), plain
    lines otherwise.

    Args:
        total: items expected.
        description: shown before the bar / at the start of each plain line.
        console: where to draw (default: stdout).
        enabled: False on ranks other than 0: yields a handle that does nothing.
    """
    if not enabled:
        yield _NoProgress()
        return
    console = console or Console()
    if not console.is_terminal or console.is_dumb_terminal:  # rich does not redraw on TERM=dumb
        yield ProgressHandle(total, description, console, None)
        return
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as live:
        yield ProgressHandle(total, description, console, live)
