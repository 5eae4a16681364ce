"""The dashboard offscreen: content follows the snapshots, layout fits the terminal, fallbacks work,
and a failing sink never escapes."""

from __future__ import annotations

import argparse
import io
import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from multirank import run_ranks
from rich.console import Console

from zerodram.launch.dashboard import Dashboard, check_output_paths, dashboard_mode
from zerodram.launch.dashboard_view import render, sparkline
from zerodram.launch.observe import _save_svg, observe
from zerodram.launch.progress import progress_bar
from zerodram.runtime.errors import ConfigError, RankTimeoutError
from zerodram.runtime.metrics import (
    PHASES,
    ClusterSampler,
    ClusterSnapshot,
    InProcessBus,
    KvQualityLayer,
    KvStats,
    MetricsReader,
    PhaseStats,
    RankSnapshot,
    WarningRecord,
)
from zerodram.runtime.metrics.summary import fmt_rate, json_line, plain_line
from zerodram.runtime.topology import load_topology, resolve_topology_path


@pytest.fixture(scope="module")
def topo4():
    return load_topology(resolve_topology_path("local-cpu-4"))


def make_snapshot(rank: int, world_size: int, num_experts: int, *, num_layers: int = 4) -> RankSnapshot:
    """A snapshot whose numbers encode the rank, so a reader can tell whose row is whose."""
    phases = tuple(PhaseStats(p, 1.0 + rank, 2.0 + rank, 1.0 + rank, 50) for p in PHASES)
    total = PhaseStats("total", 5.0 + rank, 9.5 + rank, 6.0 + rank, 50)
    counts = [10] * num_experts
    counts[(rank * 3) % num_experts] = 90  # each rank has a hot expert of its own
    return RankSnapshot(
        rank=rank,
        seq=1,
        time_s=1_700_000_000.0 + rank,
        uptime_s=10.0,
        num_steps=500,
        num_tokens=4000,
        tokens_per_s=1234.5 + 100 * rank,
        phases=(*phases, total),
        num_running=8 + rank,
        num_queued=rank,
        kv=KvStats(10 * (rank + 1), 100 - 10 * (rank + 1), 1000, 8000),
        expert_idx=tuple(range(num_experts)),
        expert_counts=tuple(counts),
        send_bytes_per_s=tuple(1e6 for _ in range(world_size)),
        kv_quality=tuple(KvQualityLayer(i, 0.1 + 0.01 * rank, 0.05, 0.12, 10) for i in range(num_layers)),
        num_warnings=1,
        recent_warnings=(WarningRecord(1_700_000_000.0 + rank, "warning", f"rank {rank} is slow"),),
    )


def cluster_of(world_size: int, num_experts: int, **kw) -> ClusterSnapshot:
    snaps = {r: make_snapshot(r, world_size, num_experts) for r in range(world_size)}
    return ClusterSnapshot.from_snapshots(snaps, world_size, **kw)


def to_text(renderable, width: int, height: int = 60) -> str:
    console = Console(record=True, width=width, height=height, force_terminal=False, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_render_shows_every_rank_with_its_numbers(topo4) -> None:
    cluster = cluster_of(4, 32)
    text = to_text(render(cluster, topo4, width=140, height=60), 140)
    assert "local-cpu-4" in text
    assert "4/4 ok" in text
    assert "localhost" in text
    for status in cluster.ranks:
        snap = status.snapshot
        (row,) = [line for line in text.splitlines() if f"  r{snap.rank} cpu" in line]
        assert fmt_rate(snap.tokens_per_s) in row
        assert f"{snap.phase('total').p50_ms:.2f}" in row
        assert f"{snap.phase('total').p99_ms:.2f}" in row
        assert f"{snap.kv.occupancy:.0%}" in row
        assert f"r{snap.rank} warning: rank {snap.rank} is slow" in text
    assert fmt_rate(cluster.tokens_per_s) in text.splitlines()[0]
    # expert heatmap: a row per source rank plus the total; the hottest expert is named
    assert all(f"r{r}  →" in text for r in range(4))
    assert "all " in text
    assert "K 13.0%  V 5.0%  q·k 12.0%" in text  # KV quality: the worst rank (3) per layer
    assert "hottest e0 on r0: 120 tok" in text  # rank 0 routes 90 to e0, the other three 10 each


def test_render_fits_the_terminal(topo4) -> None:
    cluster = cluster_of(4, 32)
    for width in (50, 80, 120, 200):
        for height in (10, 20, 40):
            text = to_text(render(cluster, topo4, width=width, height=height), width)
            lines = text.rstrip("\n").splitlines()
            assert max(len(line) for line in lines) <= width, (width, height)
            assert len(lines) <= max(height, 12), (width, height, len(lines))  # 12: the smallest layout


def test_render_groups_a_two_node_topology_and_buckets_many_experts() -> None:
    topo = load_topology(resolve_topology_path("hgx-h100-2x8"))
    cluster = cluster_of(16, topo.experts.num_experts)
    text = to_text(render(cluster, topo, width=100, height=60), 100)
    assert "16 ranks on 2 nodes" in text
    assert text.index("hgx-0") < text.index("  r0 gpu0") < text.index("hgx-1") < text.index("  r8 gpu0")
    assert "experts/cell" in text  # 256 experts do not fit in 100 columns


def test_render_marks_stale_and_missing_ranks(topo4) -> None:
    snaps = {r: make_snapshot(r, 4, 32) for r in range(3)}
    cluster = ClusterSnapshot.from_snapshots(snaps, 4, stale=(1,))
    text = to_text(render(cluster, topo4, width=140), 140)
    assert "2/4 ok" in text
    assert "stale" in next(line for line in text.splitlines() if "  r1 cpu" in line)
    assert "missing" in next(line for line in text.splitlines() if "  r3 cpu" in line)
    # stale ranks do not count towards the cluster's throughput
    assert cluster.tokens_per_s == pytest.approx(sum(snaps[r].tokens_per_s for r in (0, 2)))


def test_render_without_topology_or_data() -> None:
    empty = ClusterSnapshot.from_snapshots({}, 2)
    text = to_text(render(empty, None, width=80), 80)
    assert "0/2 ok" in text
    assert "missing" in text
    assert "no tokens routed yet" in text


def test_plain_and_json_lines(topo4) -> None:
    cluster = cluster_of(4, 32, stale=(3,))
    line = plain_line(cluster, topo4.name, 12.0)
    assert line.startswith("zerodram local-cpu-4 t=12s | 3/4 ok")
    assert f"{fmt_rate(cluster.tokens_per_s)} tok/s" in line
    assert "step p50 7.00 ms p99 11.50 ms" in line  # the slowest fresh rank (rank 2)
    assert "not fresh: r3 stale" in line
    assert "\n" not in line
    record = json.loads(json_line(cluster, 12.0))
    assert record["tokens_per_s"] == pytest.approx(cluster.tokens_per_s)
    assert [r["status"] for r in record["ranks"]] == ["ok", "ok", "ok", "stale"]
    assert record["ranks"][2]["snapshot"]["tokens_per_s"] == pytest.approx(1434.5)


def test_sparkline() -> None:
    assert sparkline([0, 1, 2, 4], 10) == "▁▃▅█"
    assert sparkline([5, 5, 5], 2) == "██"
    assert sparkline([], 5) == ""
    assert sparkline([2, float("nan"), 4, float("inf"), -4], 10) == "▅-█-▁"


def test_render_draws_non_finite_numbers_as_dashes(topo4) -> None:
    """One NaN or inf from a rank must not break the view (the live sink would go off)."""
    nan, inf = float("nan"), float("inf")
    snaps = {}
    for r in range(4):
        good = make_snapshot(r, 4, 32)
        phases = tuple(PhaseStats(p.name, nan, inf, inf if r % 2 else nan, 5) for p in good.phases)
        snaps[r] = replace(
            good,
            phases=phases,
            tokens_per_s=inf,
            send_bytes_per_s=(nan,) * 4,
            kv_quality=(KvQualityLayer(0, inf, nan, inf, 3),),
            recent_warnings=(WarningRecord(nan, "warning", "odd clock"), WarningRecord(1e30, "error", "far")),
        )
    cluster = ClusterSnapshot.from_snapshots(snaps, 4)
    text = to_text(render(cluster, topo4, width=140, height=60, throughput=[1.0, nan, inf]), 140)
    row = next(line for line in text.splitlines() if "  r1 cpu" in line)
    assert row.split()[3:6] == ["-", "-", "-"], row  # p50, p99, tok/s
    assert "--:--:-- r0 warning: odd clock" in text
    assert "worst L0 -" in text
    assert "nan" not in text.lower() and "inf " not in text
    assert plain_line(cluster, "t", 1.0).startswith("zerodram t t=1s | 4/4 ok | - tok/s | run")


def _bus_with_data(world_size: int = 4) -> InProcessBus:
    bus = InProcessBus(world_size)
    for r in range(world_size):
        bus.publisher(r).publish(make_snapshot(r, world_size, 32).to_json())
    return bus


def test_live_mode_falls_back_to_plain_without_a_terminal(topo4) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=100)
    assert dashboard_mode(False, console) == "plain"
    assert dashboard_mode(True, console) == "plain"
    dash = Dashboard(topo4, _bus_with_data().reader(), mode="live", console=console)
    assert dash.mode == "plain"
    dash.start()
    dash.stop()
    dash.stop()
    lines = out.getvalue().splitlines()
    assert lines
    assert all(line.startswith("zerodram local-cpu-4") for line in lines)
    assert "4/4 ok" in lines[-1]


def test_a_dumb_terminal_gets_plain_lines(topo4, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "dumb")  # rich Live would not redraw there: nothing would show
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    assert dashboard_mode(False, console) == "plain"
    dash = Dashboard(topo4, _bus_with_data().reader(), mode="live", console=console)
    assert dash.mode == "plain"
    dash.start()
    dash.stop()
    assert out.getvalue().startswith("zerodram local-cpu-4")


def test_the_last_frame_after_a_failure_does_not_call_a_silent_rank_ok(topo4) -> None:
    bus = _bus_with_data()
    for r in (0, 1, 3):  # rank 2 says nothing more: killed
        bus.publisher(r).publish(replace(make_snapshot(r, 4, 32), seq=2, state="stopped").to_json())
    out = io.StringIO()
    dash = Dashboard(topo4, bus.reader(), mode="plain", console=Console(file=out, width=300)).start()
    dash.stop(failed=True)
    assert [s.status for s in dash.last.ranks] == ["stopped", "stopped", "unknown", "stopped"]
    assert out.getvalue().splitlines()[-1].endswith("| not fresh: r2 unknown")
    frame = to_text(dash.view(dash.last, 140, 60), 140)
    assert "unknown" in next(line for line in frame.splitlines() if "  r2 cpu" in line)


def test_unwritable_output_paths_are_refused_up_front(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")

    def check(metrics_file: Path | None = None, svg: Path | None = None) -> None:
        check_output_paths(argparse.Namespace(metrics_file=metrics_file, svg=svg))

    check(tmp_path / "new" / "m.jsonl", tmp_path / "file")  # folders are made when written; files reused
    with pytest.raises(ConfigError, match=r"--metrics-file .* is a directory; give a file path"):
        check(metrics_file=tmp_path)
    with pytest.raises(ConfigError, match=r"--svg .*/file/x\.svg: .*/file is not a directory"):
        check(svg=tmp_path / "file" / "x.svg")


def test_an_svg_that_cannot_be_saved_is_reported_not_raised(
    tmp_path: Path, topo4, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    dash = Dashboard(topo4, _bus_with_data().reader(), mode="plain", console=Console(file=io.StringIO()))
    dash.start()
    dash.stop()
    _save_svg(dash, tmp_path / "file" / "x.svg")
    assert "could not save --svg" in capsys.readouterr().err
    assert "svg" in dash.failed


def test_metrics_file_gets_json_lines(tmp_path: Path, topo4) -> None:
    path = tmp_path / "sub" / "metrics.jsonl"
    dash = Dashboard(topo4, _bus_with_data().reader(), mode="off", metrics_file=path, refresh_hz=50)
    dash.metrics_every_s = 0.02
    dash.start()
    deadline = time.monotonic() + 5
    while (not path.exists() or len(path.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.02)
    dash.stop()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) >= 3
    assert all(len(r["ranks"]) == 4 for r in records)


def test_a_render_failure_is_logged_once_and_does_not_propagate(
    tmp_path: Path, topo4, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("cannot draw")

    console = Console(file=io.StringIO(), force_terminal=True, width=100, height=30)
    path = tmp_path / "m.jsonl"
    dash = Dashboard(topo4, _bus_with_data().reader(), console=console, metrics_file=path, renderer=broken)
    dash.refresh_hz, dash.period_s, dash.metrics_every_s = 50, 0.02, 0.0
    assert dash.mode == "live"
    with caplog.at_level(logging.ERROR, logger="zerodram.dashboard"):
        dash.start()
        deadline = time.monotonic() + 5
        while len(path.read_text().splitlines() if path.exists() else []) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        dash.stop()
    assert len(calls) == 1, "rendering stops after the first failure"
    assert "RuntimeError: cannot draw" in dash.failed["live"]
    assert len([r for r in caplog.records if "live" in r.getMessage()]) == 1
    assert len(path.read_text().splitlines()) >= 4, "the other sinks go on"
    assert "zerodram local-cpu-4 t=" in console.file.getvalue(), "plain lines instead of the live view"


class _BrokenReader(MetricsReader):
    world_size = 4

    def read(self) -> dict[int, str]:
        raise OSError("connection reset")


def test_dashboard_survives_a_broken_reader(topo4) -> None:
    out = io.StringIO()
    dash = Dashboard(topo4, _BrokenReader(), mode="plain", console=Console(file=out, width=200))
    dash.start()
    dash.stop()
    assert dash.last.error == "OSError: connection reset"
    assert "transport: OSError: connection reset" in out.getvalue()


def test_sampler_feeds_render_end_to_end(topo4) -> None:
    cluster = ClusterSampler(_bus_with_data().reader(), 4).sample()
    assert [r.status for r in cluster.ranks] == ["ok"] * 4
    assert "4/4 ok" in to_text(render(cluster, topo4), 120)


def test_progress_bar_plain_and_live() -> None:
    out = io.StringIO()
    with progress_bar(
        20, "bench dispatch", console=Console(file=out, force_terminal=False, width=200)
    ) as bar:
        for i in range(20):
            bar.advance(note=f"case {i}")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("bench dispatch: 1/20 (5%)")
    assert lines[-1].startswith("bench dispatch: 20/20 (100%)")
    assert len(lines) <= 12
    out = io.StringIO()
    with progress_bar(3, "sweep", console=Console(file=out, force_terminal=True, width=80)) as bar:
        bar.advance(3)
    assert "3/3" in out.getvalue()
    with progress_bar(3, "quiet", enabled=False) as bar:
        bar.advance()
    assert bar.done == 1


def _observe_while_rank_one_fails(ctx, metrics_file: str) -> tuple[str, list[str]]:
    import torch

    model = SimpleNamespace(config=SimpleNamespace(num_layers=1, hidden_size=16), dtype=torch.float32)
    engine = SimpleNamespace(
        model=model, expert_to_rank=(0, 1), expert_owners=((0,), (1,)), kv=None,
        attach_observer=lambda *args, **kwargs: None,
    )
    args = argparse.Namespace(no_dashboard=True, metrics_file=Path(metrics_file), svg=None)
    try:
        with observe(ctx, engine, args, console=Console(file=io.StringIO())):
            if ctx.rank == 1:
                raise ValueError("rank 1 failed while serving")
        err = "no error"
    except (ValueError, RankTimeoutError) as e:
        err = f"{type(e).__name__}: {e}"
    return err, [t.name for t in threading.enumerate() if t.name.startswith("zerodram")]


@pytest.mark.slow
def test_observe_stops_its_threads_and_records_a_peer_failure(tmp_path: Path) -> None:
    """Rank 1 fails while serving: rank 0's closing barrier fails, and still both threads stop and
    rank 0's last frame shows both ranks stopped, each with its failure counted."""
    path = tmp_path / "metrics.jsonl"
    (err0, threads0), (err1, threads1) = run_ranks(
        _observe_while_rank_one_fails, 2, args=(str(path),), timeout_s=60, rank_timeout_s=5
    )
    assert err1 == "ValueError: rank 1 failed while serving"
    assert err0.startswith("RankTimeoutError: rank 0/2: barrier 'serving done, final metrics published'"), (
        err0
    )
    assert threads0 == threads1 == []
    last = json.loads(path.read_text().splitlines()[-1])["ranks"]
    assert [r["status"] for r in last] == ["stopped", "stopped"]
    assert last[0]["snapshot"]["num_timeouts"] == 1
    assert last[1]["snapshot"]["num_errors"] == 1
