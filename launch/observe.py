"""What a serving job shows: metrics on every rank, the dashboard on rank 0.

    with observe(ctx, engine, args) as dash:     # args from add_dashboard_args
        ...serve (collective)...

Every rank records its engine's metrics and publishes snapshots (runtime/metrics); rank 0 runs
the dashboard thread (live on a terminal, plain lines otherwise, JSON lines to --metrics-file).
On a clean exit every rank publishes its final numbers and waits for the others, so rank 0's last
frame shows the whole run with every rank still "ok"; after an error nobody waits
(the job is failing anyway), a barrier that fails (a peer failed) counts as an error, and rank 0's
last frame shows a rank that has not said it stopped as "unknown" (it may have died).
An `--svg` that cannot be saved is reported (and kept in `dash.failed["svg"]`), never raised: the
run's results must still come out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from zerodram.launch.dashboard import Dashboard, dashboard_mode
from zerodram.runtime.engine.metrics_bridge import start_metrics
from zerodram.runtime.metrics import StoreReader

SVG_SIZE = (120, 40)  # cells: what docs/dashboard.svg is drawn at


@contextmanager
def observe(
    ctx: Any, engine: Any, args: argparse.Namespace, *, console: Console | None = None
) -> Iterator[Dashboard | None]:
    """Metrics for `engine` on this rank, and on rank 0 the dashboard (yielded; None elsewhere).

    Args:
        args: `no_dashboard`, `metrics_file`, `svg` (see `add_dashboard_args`).
        console: where rank 0 draws (default stdout; serve passes stderr when stdout carries results).
    """
    collector, agent = start_metrics(engine, ctx)
    dash, failed = None, False
    if ctx.rank == 0:
        console = console or Console()
        dash = Dashboard(
            ctx.topology,
            StoreReader(ctx.world_size),
            mode=dashboard_mode(args.no_dashboard, console),
            metrics_file=args.metrics_file,
            console=console,
            expert_to_rank=engine.expert_to_rank,
        ).start()
    try:
        yield dash
        agent.publish_now()
        ctx.barrier("serving done, final metrics published")
        if dash is not None:
            dash.stop()
            if args.svg is not None:
                _save_svg(dash, args.svg)
        ctx.barrier("last frame drawn")  # before any rank's agent publishes "stopped"
    except BaseException as err:  # the job's, or a barrier's: a peer failed
        collector.failed(err)
        failed = True
        raise
    finally:
        # Whichever way the block ends, both threads stop (a live one left at exit can abort the
        # interpreter). The agent first: its "stopped" snapshot carries the failure recorded
        # above, so that rank 0's last frame says why (both stops are idempotent).
        agent.stop()
        if dash is not None:
            dash.stop(failed=failed)


def _save_svg(dash: Dashboard, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        dash.export(*SVG_SIZE, frame="busiest").save_svg(str(path), title="zerodram demo")
    except Exception as err:  # the disk (checked before the run, yet it may say no) or the drawing:
        # raising here would skip the next barrier and lose the run's answers
        dash.failed["svg"] = f"{type(err).__name__}: {err}"
        print(f"zerodram: error: could not save --svg {path}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
