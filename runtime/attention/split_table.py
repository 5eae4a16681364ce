"""Measured split counts: for one GPU model, one decode-kernel build, KV head count and page size,
the fastest number of FP2 splits at each (batch size, FP2 length) of a grid, timed on that GPU
(`benchmarks/split_table.py` builds them from `benchmarks/attention.py` sweeps).
`Fp2DecodeAttention.plan` takes a table's count where one covers the step and the wave model
elsewhere.

Why a table: on an H100 no wave model fits both ends. At B <= 16 one or two split CTAs an SM were
fastest, at B = 32 three; timed side by side, the wave model's counts (up to three an SM) took
0.3-18.5% longer at B = 1-16 wherever the two differ (docs/fp2-kernel.md, "Split plan and merge",
stop 48). The same kernel on the H200 wanted three an SM already at B = 8 (stop 22), so the counts
are measured per GPU model, as vLLM ships its fused MoE configs per device name.

Files: `split_tables/<device name, non-alphanumerics as _>.json`, package data:

    {"device": "NVIDIA H100 80GB HBM3",
     "tables": [{"kernel": "<Fp2KernelConfig.split_key()>", "num_kv_heads": 8, "page_size": 64,
                 "measured": "<date, machine, tree, command>",
                 "splits": {"<B>": {"<L>": count, ...}, ...}}]}

The grid is a full rectangle: every B row holds the same L columns. A lookup takes the batch's own
row and the smallest grid L >= the length (the buckets a captured step uses are powers of two, so
they land on grid points). A batch size not on the grid, or a length beyond it, has no count: the
wave model plans it. (Keeping a grid point's split CTAs for the batch sizes between, 3 splits at
B = 12 from B = 16's 2, ran 16-19% slower than the wave model's 4 on the H100: stop 48.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from zerodram.runtime.errors import ConfigError

TABLE_DIR = Path(__file__).with_name("split_tables")


def device_file(device_name: str, table_dir: Path = TABLE_DIR) -> Path:
    """The table file of a GPU model: its name, non-alphanumerics as underscores."""
    return table_dir / (re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") + ".json")


@dataclass(frozen=True)
class SplitTable:
    """One kernel build's measured counts on one GPU model.

    counts: {B: {L: splits}} over a full grid (every B has the same Ls), all positive.
    """

    device: str
    kernel: str
    num_kv_heads: int
    page_size: int
    measured: str
    counts: dict[int, dict[int, int]] = field(repr=False)

    def __post_init__(self) -> None:
        where = f"split table {self.device!r} / {self.kernel!r} / {self.num_kv_heads} kv heads"
        if not self.counts:
            raise ConfigError(f"{where}: no batch sizes")
        if self.num_kv_heads < 1 or self.page_size < 1:
            raise ConfigError(f"{where}: kv heads and page size must be positive, got page size {self.page_size}")
        lengths = self.lengths
        for b, row in self.counts.items():
            if b < 1 or sorted(row) != lengths or not lengths or min(lengths) < 1:
                raise ConfigError(
                    f"{where}: batch {b} covers lengths {sorted(row)}, the grid needs {lengths} (all >= 1)"
                )
            if any(s < 1 for s in row.values()):
                raise ConfigError(f"{where}: batch {b} has a count below 1: {row}")

    @cached_property
    def lengths(self) -> list[int]:
        """The grid's lengths, ascending (read by every plan of an eager step)."""
        return sorted(next(iter(self.counts.values())))

    def lookup(self, batch_size: int, max_len: int) -> int | None:
        """The measured count for a batch of `batch_size` whose longest FP2 range is `max_len`, or
        None where the grid has no such batch size or no length that long."""
        length = next((g for g in self.lengths if g >= max_len), None)
        if batch_size not in self.counts or length is None:
            return None
        return self.counts[batch_size][length]

    def to_json(self) -> dict:
        return {
            "kernel": self.kernel, "num_kv_heads": self.num_kv_heads, "page_size": self.page_size,
            "measured": self.measured,
            "splits": {str(b): {str(n): s for n, s in sorted(row.items())} for b, row in sorted(self.counts.items())},
        }  # fmt: skip


def parse_tables(text: str, source: str) -> list[SplitTable]:
    """Every table in one file's text. Raises ConfigError naming `source` and the field."""
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{source}: not JSON: {err}") from None
    except ValueError as err:  # a repeated key
        raise ConfigError(f"{source}: {err}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("device"), str) or not isinstance(doc.get("tables"), list):
        raise ConfigError(f"{source}: needs a 'device' string and a 'tables' list")
    out = []
    for i, t in enumerate(doc["tables"]):
        at = f"{source}: tables[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(f"{at}: not an object")
        for key, kind in (("kernel", str), ("num_kv_heads", int), ("page_size", int), ("measured", str), ("splits", dict)):
            if not isinstance(t.get(key), kind) or isinstance(t.get(key), bool):
                raise ConfigError(f"{at}.{key}: expected {kind.__name__}, got {t.get(key)!r}")
        counts: dict[int, dict[int, int]] = {}
        for b, row in t["splits"].items():
            if not isinstance(row, dict):
                raise ConfigError(f"{at}.splits[{b!r}]: expected an object of length: count")
            if any(not isinstance(s, int) or isinstance(s, bool) for s in row.values()):
                raise ConfigError(f"{at}.splits[{b!r}]: counts must be integers, got {row}")
            if not b.isdigit() or not all(n.isdigit() for n in row) or int(b) in counts:
                raise ConfigError(f"{at}.splits[{b!r}]: batch sizes and lengths must be distinct plain integers")
            counts[int(b)] = {int(n): s for n, s in row.items()}
            if len(counts[int(b)]) != len(row):
                raise ConfigError(f"{at}.splits[{b!r}]: a length appears twice")
        try:
            out.append(SplitTable(doc["device"], t["kernel"], t["num_kv_heads"], t["page_size"], t["measured"], counts))
        except ConfigError as err:
            raise ConfigError(f"{at}: {err}") from None
    builds = [(t.kernel, t.num_kv_heads, t.page_size) for t in out]
    if len(set(builds)) != len(builds):
        raise ConfigError(f"{source}: two tables for one kernel build, kv heads and page size")
    return out


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key appears twice in one object: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    return dict(pairs)


def find_table(
    device_name: str, kernel: str, num_kv_heads: int, page_size: int, table_dir: Path = TABLE_DIR
) -> SplitTable | None:
    """The packaged table for this GPU model and kernel build, or None (no file, or none that
    matches). A malformed file raises ConfigError: a shipped table that cannot be read is a bug."""
    path = device_file(device_name, table_dir)
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text: {err}") from None
    # two device names may share a file name: a file of the other one's tables has none for this
    for t in parse_tables(text, str(path)):
        if (t.device, t.kernel, t.num_kv_heads, t.page_size) == (device_name, kernel, num_kv_heads, page_size):
            return t
    return None


def merge_table(table: SplitTable, table_dir: Path = TABLE_DIR, *, replace_all: bool = False) -> Path:
    """Write `table` into its device's file, replacing one of the same kernel, kv heads and page
    size; the others stay. A table over the same lengths that leaves out some of that one's batch
    sizes (a sweep of those rows again, or of batch sizes it lacks) replaces or adds only its rows,
    and its record is appended to the old one's (records pile up, oldest first). A table that would
    drop batch sizes or lengths the old one measured raises ConfigError unless `replace_all`.
    Returns the file's path."""
    path = device_file(table.device, table_dir)
    old = parse_tables(path.read_text(), str(path)) if path.is_file() else []
    same = (table.kernel, table.num_kv_heads, table.page_size)
    prev = next((t for t in old if (t.kernel, t.num_kv_heads, t.page_size) == same), None)
    if prev is not None and not replace_all:
        lost_b, lost_l = sorted(set(prev.counts) - set(table.counts)), sorted(set(prev.lengths) - set(table.lengths))
        if lost_b and prev.lengths == table.lengths:  # rows over the same grid: merged into the old
            rows = ", ".join(map(str, sorted(table.counts)))
            table = replace(
                table, measured=f"{prev.measured}. Batch {rows}: {table.measured}", counts=prev.counts | table.counts
            )
        elif lost_b or lost_l:
            raise ConfigError(
                f"{path}: this table would drop the measured batch sizes {lost_b} and lengths {lost_l} of "
                f"{same}; sweep them too, or replace the whole table (replace_all, bench split-table --replace)"
            )
    keep = [t for t in old if t is not prev] + [table]
    keep.sort(key=lambda t: (t.kernel, t.num_kv_heads, t.page_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dumps(table.device, [t.to_json() for t in keep]))
    return path


def _dumps(device: str, tables: list[dict]) -> str:
    """The file's text: JSON with one line per batch size, so a diff shows which counts moved."""
    parts = []
    for t in tables:
        head = "".join(f'   {json.dumps(k)}: {json.dumps(v)},\n' for k, v in t.items() if k != "splits")
        rows = ",\n".join(f"    {json.dumps(b)}: {json.dumps(row)}" for b, row in t["splits"].items())
        parts.append(f'  {{\n{head}   "splits": {{\n{rows}\n   }}\n  }}')
    return f'{{\n "device": {json.dumps(device)},\n "tables": [\n' + ",\n".join(parts) + "\n ]\n}\n"
