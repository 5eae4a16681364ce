"""Rank 0's live dashboard: every rank's metrics, laid out along the topology (rich Live).

    dash = Dashboard(topology, StoreReader(world_size), mode=dashboard_mode(args), metrics_file=...)
    dash.start()      # background thread, ~4 refreshes a second
    ...serve...
    dash.stop()       # idempotent

What a frame shows is `dashboard_view.render`, a pure function of a `ClusterSnapshot`.
Modes: "live" (a TTY), "plain" (a line every few seconds: not a TTY, or `--no-dashboard`), "off".
`--metrics-file PATH` appends one JSON line per second in any mode. The dashboard never stops the
engine: it reads snapshots from the transport on its own daemon thread, and a sink that fails
(rendering, printing, writing) is logged once and switched off (a live display gives way to plain
lines) while serving goes on.
This module is launch-side only; the engine never imports it.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from rich.console import Console, RenderableType
from rich.live import Live

from zerodram.launch.dashboard_view import render
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.metrics import ClusterSampler, ClusterSnapshot, MetricsReader
from zerodram.runtime.metrics.summary import json_line, plain_line

log = logging.getLogger("zerodram.dashboard")

MODES = ("live", "plain", "off")


# ---------------------------------------------------------------- the running dashboard


def add_dashboard_args(parser: argparse.ArgumentParser) -> None:
    """Add `--no-dashboard`, `--metrics-file PATH` and `--svg PATH` to a command (serve, demo)."""
    parser.add_argument(
        "--no-dashboard", action="store_true", help="print a plain status line every few seconds instead"
    )
    parser.add_argument("--metrics-file", type=Path, metavar="PATH", help="append one JSON line per second")
    parser.add_argument(
        "--svg", type=Path, metavar="PATH", help="save the busiest frame of the run as an SVG (rank 0)"
    )


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse a `--metrics-file` or `--svg` that cannot be written, before any model loads (run
    it where rank 0 runs): a finished run must not end by failing to write its output.

    Raises:
        ConfigError: naming the flag, the path and why.
    """
    for flag, path in (("--metrics-file", args.metrics_file), ("--svg", args.svg)):
        if path is None:
            continue
        if path.is_dir():
            raise ConfigError(f"{flag} {path} is a directory; give a file path")
        # the nearest existing folder above it: rank 0 creates the missing ones when it writes
        folder = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
        if folder != path.absolute() and not folder.is_dir():
            raise ConfigError(f"{flag} {path}: {folder} is not a directory")
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"{flag} {path}: {folder} is not writable")


def dashboard_mode(no_dashboard: bool, console: Console | None = None) -> str:
    """The mode to run: "plain" with `--no-dashboard` or where `live` cannot draw, else "live"."""
    console = console or Console()
    return "plain" if no_dashboard or not _can_redraw(console) else "live"


def _can_redraw(console: Console) -> bool:
    # rich Live does not redraw on TERM=dumb (nor off a terminal): it would show nothing at all
    return console.is_terminal and not console.is_dumb_terminal


class Dashboard:
    """Rank 0's dashboard thread: sample every rank, then draw (live), print (plain) and log
    (metrics file). Each of those sinks fails alone: logged once, switched off (live: plain lines
    instead); the thread and the engine go on.

    Args:
        topology: the job's topology (duck-typed: name, world_size, ranks, experts), or None.
        reader: the transport's reading end; its `world_size` is the ranks expected.
        mode: "live", "plain" or "off". "live" without a terminal (or on TERM=dumb) is "plain".
        metrics_file: append a JSON line per `metrics_every_s` here (any mode).
        console: where to draw / print (default: stdout).
        refresh_hz: samples (and live redraws) per second.
        plain_every_s: seconds between plain lines.
        stale_after_s: a rank whose snapshot has not changed for this long is shown stale.
        renderer: the view function (default `render`), injectable for tests.
        expert_to_rank: the served model's expert placement (see `render`).
    """

    def __init__(
        self,
        topology: Any,
        reader: MetricsReader,
        mode: str = "live",
        metrics_file: str | Path | None = None,
        console: Console | None = None,
        *,
        refresh_hz: float = 4.0,
        plain_every_s: float = 5.0,
        metrics_every_s: float = 1.0,
        stale_after_s: float = 3.0,
        history: int = 240,
        renderer: Callable[..., RenderableType] = render,
        expert_to_rank: Sequence[int] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"dashboard mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.topology = topology
        self.console = console or Console()
        self.mode = "plain" if mode == "live" and not _can_redraw(self.console) else mode
        self.metrics_file = Path(metrics_file) if metrics_file is not None else None
        self.sampler = ClusterSampler(reader, reader.world_size, stale_after_s=stale_after_s)
        self.period_s = 1.0 / refresh_hz
        self.plain_every_s, self.metrics_every_s = plain_every_s, metrics_every_s
        self.renderer = renderer
        self.expert_to_rank = tuple(expert_to_rank) if expert_to_rank else None
        self.throughput: deque[float] = deque(maxlen=history)
        self.last: ClusterSnapshot | None = None
        # the sample of highest cluster tokens/s and the throughput history up to it (`export`)
        self.busiest: tuple[ClusterSnapshot, tuple[float, ...]] | None = None
        self.failed: dict[str, str] = {}  # sink -> first error
        self._t0 = time.monotonic()
        self._due = {"plain": 0.0, "file": 0.0}
        self._live: Live | None = None
        self._file: IO[str] | None = None
        self._sinks: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = "new"  # new -> started -> stopped

    def start(self) -> Dashboard:
        """Open the sinks and start the thread (once); returns self."""
        if self._state != "new":
            return self
        self._state = "started"
        self._sinks = [self.mode] if self.mode != "off" else []
        if self.metrics_file is not None:
            self._sinks.append("file")
        if "live" in self._sinks:
            self._guard("live", self._open_live)
        if "file" in self._sinks:
            self._guard("file", self._open_file)
        if self._sinks:
            self._thread = threading.Thread(target=self._run, name="zerodram-dashboard", daemon=True)
            self._thread.start()
        return self

    def _open_live(self) -> None:
        self._live = Live(console=self.console, auto_refresh=False, vertical_overflow="crop")
        self._live.start()

    def _open_file(self) -> None:
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.metrics_file.open("a", encoding="utf-8")

    def _run(self) -> None:
        while self._sinks and not self._stop.wait(self.period_s):
            self.tick()

    def tick(self, *, force: bool = False, failed: bool = False) -> ClusterSnapshot:
        """Sample once and feed every sink that is due, or all with `force` (the thread calls
        this; tests may too). `failed`: see `ClusterSampler.sample`."""
        cluster = self.sampler.sample(failed=failed)
        self.last = cluster
        self.throughput.append(cluster.tokens_per_s)
        if self.busiest is None or cluster.tokens_per_s >= self.busiest[0].tokens_per_s:
            self.busiest = (cluster, tuple(self.throughput))
        now = time.monotonic()
        if "live" in self._sinks:
            self._guard("live", self._draw, cluster)
        if "plain" in self._sinks and (force or now >= self._due["plain"]):
            self._due["plain"] = now + self.plain_every_s
            self._guard("plain", self._print, cluster)
        if "file" in self._sinks and (force or now >= self._due["file"]):
            self._due["file"] = now + self.metrics_every_s
            self._guard("file", self._write, cluster)
        return cluster

    def _draw(self, cluster: ClusterSnapshot) -> None:
        width, height = self.console.size
        self._live.update(self.view(cluster, width, height), refresh=True)

    def view(
        self, cluster: ClusterSnapshot, width: int, height: int, throughput: Sequence[float] | None = None
    ) -> RenderableType:
        """The frame for `cluster` at this size (with the throughput history so far by default)."""
        return self.renderer(
            cluster,
            self.topology,
            width=width,
            height=height,
            throughput=self.throughput if throughput is None else throughput,
            expert_to_rank=self.expert_to_rank,
        )

    def export(self, width: int = 120, height: int = 40, *, frame: str = "last") -> Console:
        """A frame drawn on an offscreen recording console (`export_text`, `save_svg`).

        Args:
            frame: "last" (the final sample) or "busiest" (the sample of highest tokens/s, with
                the sparkline as it was then: what a run looks like while it serves).

        Raises:
            RuntimeError: nothing was sampled yet.
        """
        if self.last is None or self.busiest is None:
            raise RuntimeError("the dashboard has not sampled any snapshot yet")
        cluster, history = (self.last, tuple(self.throughput)) if frame == "last" else self.busiest
        console = Console(record=True, width=width, height=height, file=io.StringIO(), force_terminal=True)
        console.print(self.view(cluster, width, height, history))
        return console

    def _print(self, cluster: ClusterSnapshot) -> None:
        line = plain_line(cluster, getattr(self.topology, "name", "ad-hoc"), time.monotonic() - self._t0)
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _write(self, cluster: ClusterSnapshot) -> None:
        self._file.write(json_line(cluster, time.monotonic() - self._t0) + "\n")
        self._file.flush()

    def _guard(self, sink: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:
            # The dashboard must never take serving down: report once, drop this sink only.
            self.failed[sink] = f"{type(err).__name__}: {err}"
            log.error(
                "dashboard %s output failed (%s); it is switched off, serving continues",
                sink,
                self.failed[sink],
                exc_info=not isinstance(err, OSError),  # a path or a disk needs no traceback; a bug does
            )
            if sink in self._sinks:
                self._sinks.remove(sink)
            if sink == "live":
                self._close_live()
                if "plain" not in self._sinks:  # still show the run, in plain lines
                    self._sinks.append("plain")

    def _close_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            try:
                live.stop()
            except Exception:
                log.debug("closing the live display failed", exc_info=True)

    def stop(self, timeout_s: float = 2.0, *, failed: bool = False) -> None:
        """Stop the thread (waiting at most `timeout_s`), draw a last frame, close. Idempotent.

        Args:
            failed: the job is failing: the last frame shows a rank that has not published its
                "stopped" snapshot as "unknown", not by the age of its last one.
        """
        if self._state != "started":
            self._state = "stopped"
            return
        self._state = "stopped"
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is None or not self._thread.is_alive():
            if self._sinks:
                # the final state, so that a short run still shows (and logs) its end
                self.tick(force=True, failed=failed)
            self._sinks = []
        self._close_live()
        if self._file is not None:
            self._file.close()
            self._file = None
