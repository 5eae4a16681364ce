"""The dashboard's view: a pure function from every rank's metrics to a rich renderable.

    render(cluster, topology, width=120, height=40, throughput=[...]) -> RenderableType

Views, top to bottom: a header; the cluster table (nodes, then their ranks: state, step p50/p99,
tokens/s, requests, KV occupancy bar, phase mix, dispatch rate); the expert-load heatmap (rows:
source ranks, columns: experts grouped by owner rank); the per-layer KV-quality strip; a
throughput sparkline; recent warnings. Sections shrink or drop, in that order from the bottom, to
fit the terminal's height; every line is cropped, never wrapped. Tests render it offscreen.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.color import Color
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.style import Style
from rich.table import Table
from rich.text import Text

from zerodram.runtime.metrics import PHASES, ClusterSnapshot, RankStatus
from zerodram.runtime.metrics.summary import fmt_bytes, fmt_rate

SPARK = "▁▂▃▄▅▆▇█"
PHASE_COLORS = {"attention": "cyan", "dispatch": "magenta", "experts": "green", "combine": "yellow"}
PHASE_COLORS["sampling"] = "blue"
STATUS_STYLE = {"ok": "green", "stale": "yellow", "missing": "red", "stopped": "dim", "unknown": "red"}
LEVEL_STYLE = {"warning": "yellow", "error": "red", "timeout": "bold red"}
# Relative-error thresholds of the KV-quality strip: below the first is green, below the second
# yellow, else red. FP2 K/V carry ~0.3 relative error per element by design; the score error is
# what attention sees, so the strip colours that when it was sampled.
KV_ERR_THRESHOLDS = (0.2, 0.4)


# ---------------------------------------------------------------- formatting


def sparkline(values: Sequence[float], width: int) -> str:
    """The last `width` values as block characters scaled to their max ("-" for a NaN or inf)."""
    vals = list(values)[-width:]
    top = max((v for v in vals if math.isfinite(v)), default=0.0)
    steps = len(SPARK) - 1

    def glyph(v: float) -> str:
        if not math.isfinite(v):
            return "-"
        return SPARK[min(max(int(v / top * steps + 0.5), 0), steps)] if top > 0 else SPARK[0]

    return "".join(glyph(v) for v in vals)


def _heat(value: float, mean: float) -> Style:
    # Scaled to the mean, not the max: an even load reads green everywhere, an expert at twice
    # the mean or more reads red, an idle one recedes into dark blue.
    frac = min(max(0.5 * value / mean if mean > 0 else 0.0, 0.0), 1.0)
    stops = ((0.0, (35, 45, 90)), (0.5, (60, 170, 100)), (0.75, (235, 200, 40)), (1.0, (230, 45, 35)))
    for (f0, c0), (f1, c1) in itertools.pairwise(stops):
        if frac <= f1:
            t = (frac - f0) / (f1 - f0)
            r, g, b = (round(x + (y - x) * t) for x, y in zip(c0, c1, strict=True))
            return Style(color=Color.from_rgb(r, g, b))
    raise AssertionError("unreachable")


def _bar(frac: float, width: int, style: str = "green") -> Text:
    filled = round(min(max(frac, 0.0), 1.0) * width)
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "grey35"))


def _pct(frac: float) -> str:
    return f"{frac:.1%}" if math.isfinite(frac) else "-"


def _line(*parts: Any) -> Text:
    text = Text.assemble(*parts)
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


# ---------------------------------------------------------------- structure


def _nodes(topology: Any, world_size: int) -> list[tuple[str, list[tuple[int, str]]]]:
    """[(node label, [(rank, rank label)])], from the topology when it matches the world."""
    if topology is None or getattr(topology, "world_size", None) != world_size:
        return [("ranks", [(r, f"r{r}") for r in range(world_size)])]
    out: dict[int, tuple[str, list[tuple[int, str]]]] = {}
    for spec in topology.ranks:
        label = f"{spec.node_name}" + (f" ({spec.host})" if spec.host != spec.node_name else "")
        dev = f"gpu{spec.gpu_idx}" if spec.gpu_idx is not None else "cpu"
        out.setdefault(spec.node_idx, (label, []))[1].append((spec.rank, f"r{spec.rank} {dev}"))
    return [out[k] for k in sorted(out)]


def _ms(status: RankStatus, which: str) -> float | None:
    snap = status.snapshot
    phase = snap.phase("total") if snap is not None else None
    if phase is None or phase.num_samples == 0:
        return None
    ms = phase.p50_ms if which == "p50" else phase.p99_ms
    return ms if math.isfinite(ms) else None


def _state(status: RankStatus) -> Text:
    label = status.status
    if status.status == "stale" and status.age_s is not None:
        label = f"stale {status.age_s:.0f}s"
    return Text(label, style=STATUS_STYLE[status.status])


def _phase_mix(status: RankStatus, width: int) -> Text:
    snap = status.snapshot
    stats = [snap.phase(p) for p in PHASES] if snap is not None else []
    means = [s.mean_ms if s is not None else 0.0 for s in stats]
    total = sum(means)
    if not math.isfinite(total):  # a NaN or inf mean: no honest mix to draw
        return Text("-")
    if total <= 0:
        return Text("")
    out, used = Text(), 0
    for i, (name, mean) in enumerate(zip(PHASES, means, strict=True)):
        n = width - used if i == len(means) - 1 else round(mean / total * width)
        out.append("█" * max(n, 0), style=PHASE_COLORS[name])
        used += max(n, 0)
    return out


# ---------------------------------------------------------------- sections


def _cluster_table(cluster: ClusterSnapshot, topology: Any, width: int, collapse: bool) -> Table:
    # (header, min width, cell) in priority order; a column is shown when the width allows it.
    def row_cells(status_list: list[RankStatus], label: Text, state: Text) -> dict[str, Any]:
        snaps = [s.snapshot for s in status_list if s.snapshot is not None]
        p50s = [v for v in (_ms(s, "p50") for s in status_list) if v is not None]
        p99s = [v for v in (_ms(s, "p99") for s in status_list) if v is not None]
        live = [s.snapshot for s in status_list if s.status == "ok" and s.snapshot is not None]
        used = sum(s.kv.num_pages_used for s in snaps)
        pages = sum(s.kv.num_pages for s in snaps)
        frac = used / pages if pages else 0.0
        return {
            "rank": label,
            "state": state,
            "p50 ms": f"{max(p50s):.2f}" if p50s else "-",
            "p99 ms": f"{max(p99s):.2f}" if p99s else "-",
            "tok/s": fmt_rate(sum(s.tokens_per_s for s in live)) if live else "-",
            "run/q": f"{sum(s.num_running for s in snaps)}/{sum(s.num_queued for s in snaps)}"
            if snaps
            else "-",
            "KV": Text.assemble(_bar(frac, 10), f" {frac:4.0%}") if pages else Text("-"),
            "phases": _phase_mix(status_list[0], 16) if len(status_list) == 1 else Text(""),
            "send/s": fmt_bytes(sum(sum(s.send_bytes_per_s) for s in live)) if live else "-",
            "warn": str(sum(s.num_warnings + s.num_errors + s.num_timeouts for s in snaps)) if snaps else "-",
        }

    nodes = _nodes(topology, len(cluster.ranks))
    labels = [n for n, _ in nodes] + [f"  {label}" for _, ranks in nodes for _, label in ranks]
    rank_w = min(max(len(t) for t in labels), max(12, width // 4))
    # (header, width) in priority order; a column and all after it drop when the width runs out.
    columns = [("rank", rank_w), ("state", 9), ("p50 ms", 7), ("p99 ms", 7), ("tok/s", 7), ("KV", 15)]
    columns += [("run/q", 7), ("phases", 16), ("send/s", 10), ("warn", 4)]
    shown, used = [], 0
    for name, w in columns:
        if used + w + 2 > width and shown:
            break
        shown.append(name)
        used += w + 2
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False, padding=(0, 1))
    for name, w in columns[: len(shown)]:
        left = name in ("rank", "state", "KV", "phases")
        table.add_column(
            name, justify="left" if left else "right", no_wrap=True, overflow="ellipsis", width=w
        )
    by_rank = {s.rank: s for s in cluster.ranks}
    for node_label, ranks in nodes:
        members = [by_rank[r] for r, _ in ranks]
        num_ok = sum(s.status == "ok" for s in members)
        node_state = Text(
            f"{num_ok}/{len(members)} ok", style="green" if num_ok == len(members) else "yellow"
        )
        cells = row_cells(members, Text(node_label, style="bold"), node_state)
        table.add_row(*(cells[c] for c in shown), style="bold" if not collapse else None)
        if collapse:
            continue
        for rank, label in ranks:
            status = by_rank[rank]
            cells = row_cells([status], Text(f"  {label}"), _state(status))
            table.add_row(*(cells[c] for c in shown), style=None if status.status == "ok" else "dim")
    return table


def _heatmap(
    cluster: ClusterSnapshot,
    topology: Any,
    width: int,
    ranks_shown: bool,
    expert_to_rank: Sequence[int] | None = None,
) -> Panel:
    owners = expert_to_rank or getattr(getattr(topology, "experts", None), "expert_to_rank", None)
    num_experts = len(owners) if owners else None
    seen = [s.snapshot for s in cluster.ranks if s.snapshot is not None]
    if num_experts is None:
        num_experts = 1 + max((e for s in seen for e in s.expert_idx), default=-1)
    totals = cluster.expert_totals(num_experts)
    avail = max(width - 12, 8)
    seps = len(set(owners)) - 1 if owners else 0
    bucket = 1 if num_experts + seps <= avail else math.ceil(num_experts / avail)
    if bucket > 1:
        seps = 0

    def cells(counts: list[int], mean: float) -> Text:
        out = Text(no_wrap=True, overflow="crop")
        for b in range(0, num_experts, bucket):
            if seps and b and owners[b] != owners[b - 1]:
                out.append(" ")
            value = sum(counts[b : b + bucket])
            out.append("█" if value else "·", style=_heat(value, mean))
        return out

    lines = []
    if ranks_shown:
        rows = []
        for status in cluster.ranks:
            counts = [0] * num_experts
            if status.snapshot is not None:
                for e, c in zip(status.snapshot.expert_idx, status.snapshot.expert_counts, strict=True):
                    if e < num_experts:
                        counts[e] += c
            rows.append((status, counts))
        cells_all = [v for _, c in rows for v in _buckets(c, bucket)]
        mean = sum(cells_all) / len(cells_all) if cells_all else 0.0
        for status, counts in rows:
            style = None if status.status == "ok" else "dim"
            lines.append(Text.assemble(Text(f"r{status.rank:<3}→ ", style=style), cells(counts, mean)))
    all_cells = _buckets(totals, bucket)
    lines.append(Text.assemble(Text("all   ", style="bold"), cells(totals, sum(all_cells) / len(all_cells))))
    total = sum(totals)
    if total:
        hot = max(range(num_experts), key=totals.__getitem__)
        imbalance = max(totals) * num_experts / total
        owner = f" on r{owners[hot]}" if owners else ""
        title = (
            f"expert load · imbalance {imbalance:.2f} (max/mean) · hottest e{hot}{owner}: {totals[hot]} tok"
        )
    else:
        title = "expert load · no tokens routed yet"
    if bucket > 1:
        title += f" · {bucket} experts/cell"
    for line in lines:
        line.no_wrap, line.overflow = True, "crop"
    return Panel(Group(*lines), title=title, title_align="left", box=box.ROUNDED, padding=(0, 1))


def _buckets(counts: list[int], bucket: int) -> list[int]:
    return [sum(counts[b : b + bucket]) for b in range(0, len(counts), bucket)] or [0]


def _kv_quality(cluster: ClusterSnapshot, width: int, thresholds: tuple[float, float]) -> Panel:
    worst: dict[int, tuple[float, float, float | None]] = {}  # layer -> (k, v, score), max over ranks
    samples = 0
    for snap in cluster.live:
        for q in snap.kv_quality:
            k, v, s = worst.get(q.layer_idx, (0.0, 0.0, None))
            score = q.score_rel_err if s is None else max(s, q.score_rel_err or 0.0)
            worst[q.layer_idx] = (max(k, q.k_rel_err), max(v, q.v_rel_err), score)
            samples += q.num_samples
    if not worst:
        body: RenderableType = Text("no K/V samples yet", style="dim")
        return Panel(body, title="KV quality", title_align="left", box=box.ROUNDED, padding=(0, 1))
    num_layers = max(worst) + 1
    bucket = max(1, math.ceil(num_layers / max(width - 12, 8)))
    strip = Text("layers ", no_wrap=True, overflow="crop")

    def err(layer: int) -> float | None:
        if layer not in worst:
            return None
        k, _, s = worst[layer]
        return s if s is not None else k

    for b in range(0, num_layers, bucket):
        errs = [e for e in (err(i) for i in range(b, min(b + bucket, num_layers))) if e is not None]
        if not errs:
            strip.append("·", style="grey35")
            continue
        e = max(errs)
        strip.append("▇", style="green" if e < thresholds[0] else "yellow" if e < thresholds[1] else "red")
    ks, vs = [w[0] for w in worst.values()], [w[1] for w in worst.values()]
    ss = [w[2] for w in worst.values() if w[2] is not None]
    bad = max(worst, key=lambda i: err(i) or 0.0)
    summary = _line(
        f"K {_pct(sum(ks) / len(ks))}  V {_pct(sum(vs) / len(vs))}",
        f"  q·k {_pct(sum(ss) / len(ss))}" if ss else "",
        f"  worst L{bad} {_pct(err(bad))}  ({samples} samples)",
    )
    title = "KV quality · rel. error vs full precision, worst rank per layer"
    return Panel(Group(strip, summary), title=title, title_align="left", box=box.ROUNDED, padding=(0, 1))


def _warnings(cluster: ClusterSnapshot, num_lines: int) -> Panel:
    recent = sorted(
        ((w, s.rank) for s in cluster.ranks if s.snapshot for w in s.snapshot.recent_warnings),
        key=lambda x: -x[0].time_s,
    )
    lines = []
    if cluster.error:
        lines.append(_line(("transport: ", "bold red"), cluster.error))
    for w, rank in recent[: max(num_lines - len(lines), 0)]:
        try:
            stamp = time.strftime("%H:%M:%S", time.localtime(w.time_s))
        except (ValueError, OverflowError, OSError):  # a NaN or absurd clock on that rank
            stamp = "--:--:--"
        lines.append(_line(f"{stamp} r{rank} ", (f"{w.level}: ", LEVEL_STYLE.get(w.level, "")), w.message))
    snaps = [s.snapshot for s in cluster.ranks if s.snapshot is not None]
    counts = [sum(getattr(s, f) for s in snaps) for f in ("num_warnings", "num_errors", "num_timeouts")]
    title = f"warnings {counts[0]} · errors {counts[1]} · timeouts {counts[2]}"
    body = Group(*lines) if lines else Text("none", style="dim")
    return Panel(body, title=title, title_align="left", box=box.ROUNDED, padding=(0, 1))


# ---------------------------------------------------------------- the whole view


def render(
    cluster: ClusterSnapshot,
    topology: Any = None,
    *,
    width: int = 120,
    height: int = 40,
    throughput: Sequence[float] = (),
    kv_err_thresholds: tuple[float, float] = KV_ERR_THRESHOLDS,
    expert_to_rank: Sequence[int] | None = None,
) -> RenderableType:
    """The dashboard for one `ClusterSnapshot`, fitted to `width` x `height` cells. Pure.

    Args:
        cluster: every rank's status (from `ClusterSampler.sample()`).
        topology: lays the ranks out by node and names experts' owners (None: one flat group).
        throughput: recent cluster tokens/s, oldest first, for the sparkline.
        expert_to_rank: the served model's expert placement, when it is not the topology's
            (e.g. a dense model sliced into as many experts as ranks).
    """
    world = len(cluster.ranks)
    nodes = _nodes(topology, world)
    name = getattr(topology, "name", "ad-hoc")
    num_ok = sum(s.status == "ok" for s in cluster.ranks)
    snaps = [s.snapshot for s in cluster.ranks if s.snapshot is not None]
    saved = sum(s.kv.saved_bytes for s in snaps)
    header = _line(
        ("zerodram ", "bold"),
        f"{name} · {world} ranks on {len(nodes)} node{'s' * (len(nodes) != 1)} · ",
        (f"{num_ok}/{world} ok", "green" if num_ok == world else "yellow"),
        f" · {fmt_rate(cluster.tokens_per_s)} tok/s",
        f" · run {sum(s.num_running for s in snaps)} queue {sum(s.num_queued for s in snaps)}",
        f" · KV saved {fmt_bytes(saved)} vs BF16" if saved else "",
    )
    spark = _line("tok/s ", (sparkline(throughput, max(width - 30, 10)), "cyan"))
    spark.append(f" now {fmt_rate(cluster.tokens_per_s)}")
    if throughput:
        spark.append(f" peak {fmt_rate(max(throughput))}")
    # Height budget, in lines; shed detail bottom-up until it fits.
    heat_full = 3 + world
    budget = {"table": 2 + len(nodes) + world, "heat": heat_full, "kvq": 4, "warn": 7}
    shed = [("warn", 3), ("heat", 3), ("kvq", 0), ("warn", 0), ("table", 2 + len(nodes)), ("heat", 0)]
    for key, smaller in shed:
        if 2 + sum(budget.values()) <= height:
            break
        budget[key] = min(budget[key], smaller)
    parts: list[RenderableType] = [header]
    parts.append(_cluster_table(cluster, topology, width, collapse=budget["table"] < 2 + len(nodes) + world))
    if budget["heat"]:
        parts.append(
            _heatmap(cluster, topology, width, budget["heat"] == heat_full, expert_to_rank=expert_to_rank)
        )
    if budget["kvq"]:
        parts.append(_kv_quality(cluster, width, kv_err_thresholds))
    parts.append(spark)
    if budget["warn"]:
        parts.append(_warnings(cluster, budget["warn"] - 2))
    return Group(*parts)
