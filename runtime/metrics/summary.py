"""Text forms of a `ClusterSnapshot` for where rich cannot draw: one plain line, one JSON line.

    plain_line(cluster, name, elapsed_s)   what `--no-dashboard` / a non-TTY prints every few seconds
    json_line(cluster, elapsed_s)          what `--metrics-file` appends, once a second

The number formats (`fmt_rate`, `fmt_bytes`) are shared with the rich dashboard so that a value
reads the same everywhere. The step latency of the cluster is the *slowest* rank's: in expert
parallelism every rank waits for the slowest at dispatch and combine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from zerodram.runtime.metrics.cluster import ClusterSnapshot

JSON_LINE_VERSION = 1


def fmt_rate(value: float) -> str:
    """Tokens/s as shown everywhere: 12.3k, 456, 7.8 ("-" for NaN or inf)."""
    if not math.isfinite(value):
        return "-"
    if value >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def fmt_bytes(num: float) -> str:
    """Binary units: 512 B, 3.2 KiB, 1.5 GiB ("-" for NaN or inf)."""
    if not math.isfinite(num):
        return "-"
    if abs(num) < 1024:
        return f"{num:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        num /= 1024
        if abs(num) < 1024 or unit == "GiB":
            break
    return f"{num:.1f} {unit}"


def worst_step_ms(cluster: ClusterSnapshot) -> tuple[float, float] | None:
    """(p50, p99) of the total step, the max over fresh ranks; None before any step was timed."""
    stats = [
        p
        for p in (s.phase("total") for s in cluster.live)
        if p is not None and p.num_samples and math.isfinite(p.p50_ms) and math.isfinite(p.p99_ms)
    ]
    if not stats:
        return None
    return max(p.p50_ms for p in stats), max(p.p99_ms for p in stats)


def plain_line(cluster: ClusterSnapshot, name: str, elapsed_s: float) -> str:
    """One line summarising the cluster, e.g. ``zerodram local-cpu-4 t=12s | 4/4 ok | 812 tok/s | ...``."""
    world = len(cluster.ranks)
    snaps = [s.snapshot for s in cluster.ranks if s.snapshot is not None]
    num_ok = sum(s.status == "ok" for s in cluster.ranks)
    parts = [
        f"zerodram {name} t={elapsed_s:.0f}s",
        f"{num_ok}/{world} ok",
        f"{fmt_rate(cluster.tokens_per_s)} tok/s",
    ]
    step = worst_step_ms(cluster)
    if step is not None:
        parts.append(f"step p50 {step[0]:.2f} ms p99 {step[1]:.2f} ms")
    parts.append(f"run {sum(s.num_running for s in snaps)} queue {sum(s.num_queued for s in snaps)}")
    pages = sum(s.kv.num_pages for s in snaps)
    if pages:
        used = sum(s.kv.num_pages_used for s in snaps) / pages
        parts.append(f"kv {used:.0%} used, {fmt_bytes(sum(s.kv.saved_bytes for s in snaps))} saved")
    num_experts = 1 + max((e for s in snaps for e in s.expert_idx), default=-1)
    totals = cluster.expert_totals(num_experts)
    if sum(totals):
        hot = max(range(num_experts), key=totals.__getitem__)
        parts.append(f"experts imbalance {max(totals) * num_experts / sum(totals):.2f} hot e{hot}")
    num_warn = sum(s.num_warnings + s.num_errors + s.num_timeouts for s in snaps)
    if num_warn:
        parts.append(f"warnings {num_warn}")
    bad = [f"r{s.rank} {s.status}" for s in cluster.ranks if s.status not in ("ok", "stopped")]
    if bad:
        parts.append("not fresh: " + ", ".join(bad))
    if cluster.error:
        parts.append(f"transport: {cluster.error}")
    return " | ".join(parts)


def json_line(cluster: ClusterSnapshot, elapsed_s: float) -> str:
    """One strict JSON object (no newline): cluster totals plus every rank's status and snapshot.

    Keys: v, time_s, elapsed_s, tokens_per_s, step_p50_ms, step_p99_ms, error, ranks: [{rank,
    status, age_s, snapshot: RankSnapshot fields or null}]. A NaN or infinite number is written
    as null (JSON has no such numbers; a relative error over all-zero K rows is infinite).
    """
    step = worst_step_ms(cluster)
    record = {
        "v": JSON_LINE_VERSION,
        "time_s": cluster.time_s,
        "elapsed_s": elapsed_s,
        "tokens_per_s": cluster.tokens_per_s,
        "step_p50_ms": step[0] if step else None,
        "step_p99_ms": step[1] if step else None,
        "error": cluster.error,
        "ranks": [
            {
                "rank": s.rank,
                "status": s.status,
                "age_s": s.age_s,
                "snapshot": asdict(s.snapshot) if s.snapshot is not None else None,
            }
            for s in cluster.ranks
        ],
    }
    return json.dumps(_finite(record), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
