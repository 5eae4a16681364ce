"""Measured split tables (runtime/attention/split_table.py): lookup, the plan that takes them, the
files' parser and writer, the packaged tables, and the builder (benchmarks/split_table.py)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from attention_cases import make_attention
from bench_cli import load_script

from zerodram.runtime.attention import Fp2DecodeAttention
from zerodram.runtime.attention.split_table import (
    TABLE_DIR,
    SplitTable,
    device_file,
    find_table,
    merge_table,
    parse_tables,
)
from zerodram.runtime.errors import ConfigError

GRID = {1: {4096: 4, 131072: 32}, 8: {4096: 2, 131072: 4}, 32: {4096: 1, 131072: 8}}


def table(counts=GRID, kernel: str = "k", hkv: int = 8, device: str = "Test GPU 80GB") -> SplitTable:
    return SplitTable(device, kernel, hkv, 64, "a test", counts)


def test_lookup_takes_the_batch_row_and_the_grid_length_at_or_above() -> None:
    """A grid batch size: its row, at the next grid length. A batch size between the grid's (no
    count keeps its neighbours' speed: docs/fp2-kernel.md, stop 48) or a length beyond: none."""
    t = table()
    assert t.lookup(8, 131072) == 4 and t.lookup(1, 4096) == 4
    assert t.lookup(8, 5000) == 4 and t.lookup(8, 4096) == 2 and t.lookup(8, 1) == 2
    assert t.lookup(5, 131072) is None and t.lookup(24, 4096) is None
    assert t.lookup(33, 4096) is None and t.lookup(1, 131073) is None


def test_plan_takes_the_table_capped_at_the_minimum_split_else_the_wave_model() -> None:
    t = table()
    att = make_attention("cpu", Hq=32, Hkv=8, max_tokens=131072)
    assert att.split_table is None  # "packaged" on CPU: no GPU model to look up
    with_table = Fp2DecodeAttention(
        num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, max_batch=32, max_fp2_tokens=131072,
        split_table=t,
    )  # fmt: skip
    for B, L in ((1, 131072), (8, 131072), (8, 3000), (32, 65536), (32, 100000)):
        assert with_table.plan(B, L) == Fp2DecodeAttention.split(L, t.lookup(B, L)), (B, L)
    assert with_table.plan(1, 2048) == Fp2DecodeAttention.split(2048, 2)  # 4 capped at ceil(L / 1024)
    for B, L in ((33, 4096), (8, 200000), (3, 100000)):  # beyond the grid, or between its batch sizes
        assert with_table.plan(B, L) == att.wave_plan(B, L) == with_table.wave_plan(B, L)
    # what the engine logs once: the table and its reach, or the wave model and why
    assert att.plan_source() == "split counts from the wave model (on the CPU)"
    assert with_table.plan_source() == (
        "split counts measured on Test GPU 80GB (a test) at batch sizes [1, 8, 32] up to 131072 tokens; "
        "the wave model elsewhere"
    )


def test_workspace_covers_a_larger_count_below_the_bound() -> None:
    """`most_splits` sizes the workspace: a table may split a shorter grid length more ways than the
    bound itself (here 32 at 4k for one sequence, 2 at the 8k bound)."""
    t = table({1: {4096: 32, 8192: 2}, 2: {4096: 1, 8192: 1}})
    att = Fp2DecodeAttention(
        num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, max_batch=2, max_fp2_tokens=8192,
        split_table=t,
    )  # fmt: skip
    assert att.plan(1, 8192)[0] == 2 and att.plan(1, 4096)[0] == 4  # 32 capped at 4096 / 1024
    assert att.most_splits() == 4
    brute = max(att.plan(b, n)[0] for b in (1, 2) for n in range(1, 8193, 97))
    assert att.most_splits() >= brute


@pytest.mark.parametrize("slots", [132 * 3, 132 * 4])
def test_workspace_covers_every_planned_length(slots: int) -> None:
    """`split` rounds a count down, so the plan's count is not monotone in L (48 splits at B = 1,
    L = 53,628 but 47 at 56,962 with 396 slots); the workspace is sized by the counts asked for,
    which are. Dense over L for each bound, with every packaged table (in its shape) and without."""
    from zerodram.kernels.attention import Fp2KernelConfig

    tables = [t for path in sorted(TABLE_DIR.glob("*.json")) for t in parse_tables(path.read_text(), str(path))]
    assert len(tables) >= 2  # the H100's: the benchmark's shape and the packaged model's
    for split_table in (None, *tables):
        cfg = Fp2KernelConfig.from_split_key(split_table.kernel) if split_table else Fp2KernelConfig()
        hkv, page = (split_table.num_kv_heads, split_table.page_size) if split_table else (8, 64)
        for bound in (56962, 70000, 131072, 300000):
            att = Fp2DecodeAttention(
                num_q_heads=hkv * cfg.group, num_kv_heads=hkv, head_dim=cfg.head_dim, page_size=page, max_batch=1,
                max_fp2_tokens=bound, split_table=split_table,
            )  # fmt: skip
            att.cta_slots = slots
            worst = max(att.plan(1, n)[0] for n in range(1, bound + 1, 53))
            assert worst <= att.most_splits(), (split_table and split_table.kernel, bound, worst)
        # the premise of the sizing: the asked-for counts grow with L between the grid's lengths
        # (and beyond them, where the wave model plans)
        edges = [0, *(split_table.lengths if split_table else []), 300000]
        for b in range(1, 41):
            for lo, hi in itertools.pairwise(edges):
                counts = [att.split_count(b, n) for n in range(lo + 1, hi + 1, 211)]
                assert counts == sorted(counts), (split_table and split_table.kernel, b, lo, hi)
    old = Fp2DecodeAttention(
        num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, max_batch=1, max_fp2_tokens=56962,
        split_table=None,
    )  # fmt: skip
    old.cta_slots = 132 * 3
    assert old.plan(1, 53628)[0] == 48 > old.plan(1, 56962)[0]  # the case the old sizing missed


def test_tables_refuse_a_ragged_grid_and_bad_counts() -> None:
    with pytest.raises(ConfigError, match=r"batch 8 covers lengths \[4096\], the grid needs \[4096, 8192\]"):
        table({1: {4096: 1, 8192: 2}, 8: {4096: 1}})
    with pytest.raises(ConfigError, match=r"count below 1"):
        table({1: {4096: 0}})
    with pytest.raises(ConfigError, match=r"no batch sizes"):
        table({})


GOOD = {"kernel": "k", "num_kv_heads": 8, "page_size": 64, "measured": "m", "splits": {"1": {"4096": 2}}}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", r"f\.json: not JSON"),
        ('{"device": "G"}', r"f\.json: needs a 'device' string and a 'tables' list"),
        ('{"device": "G", "tables": [3]}', r"tables\[0\]: not an object"),
        (json.dumps({"device": "G", "tables": [{"kernel": "k"}]}), r"tables\[0\]\.num_kv_heads: expected int, got None"),
        (json.dumps({"device": "G", "tables": [GOOD | {"num_kv_heads": True}]}), r"num_kv_heads: expected int, got True"),
        (json.dumps({"device": "G", "tables": [GOOD | {"splits": {"1": {"4096": 2.5}}}]}),
         r"tables\[0\]\.splits\['1'\]: counts must be integers"),
        (json.dumps({"device": "G", "tables": [GOOD | {"splits": {"one": {"4096": 2}}}]}),
         r"splits\['one'\]: batch sizes and lengths must be distinct plain integers"),
        (json.dumps({"device": "G", "tables": [GOOD | {"splits": {}}]}),
         r"tables\[0\]: split table 'G' / 'k' / 8 kv heads: no batch sizes"),
        (json.dumps({"device": "G", "tables": [GOOD | {"page_size": -64}]}), r"must be positive, got page size -64"),
        ('{"device": "G", "tables": [], "device": "H"}', r"f\.json: a key appears twice in one object: \['device'\]"),
        (json.dumps({"device": "G", "tables": [GOOD | {"splits": {"1": {"4096": 2}, " 1": {"4096": 2}}}]}),
         r"splits\[' 1'\]: batch sizes and lengths must be distinct plain integers"),
        (json.dumps({"device": "G", "tables": [GOOD | {"splits": {"1": {"1_0": 2}}}]}),
         r"splits\['1'\]: batch sizes and lengths must be distinct plain integers"),
        (json.dumps({"device": "G", "tables": [GOOD, GOOD]}), r"two tables for one kernel build"),
    ],
)  # fmt: skip
def test_malformed_files_name_the_file_and_field(text: str, message: str) -> None:
    assert parse_tables(json.dumps({"device": "G", "tables": [GOOD]}), "f.json")[0].counts == {1: {4096: 2}}
    with pytest.raises(ConfigError, match=message):
        parse_tables(text, "f.json")


def test_merge_replaces_the_same_build_and_round_trips(tmp_path: Path) -> None:
    a, b = table(kernel="a"), table(kernel="b", hkv=4)
    path = merge_table(a, tmp_path)
    merge_table(b, tmp_path)
    assert path == device_file("Test GPU 80GB", tmp_path) and path.name == "Test_GPU_80GB.json"
    a2 = table({1: {4096: 3}}, kernel="a")
    merge_table(a2, tmp_path, replace_all=True)  # a grid of fewer rows and lengths: asked for
    assert parse_tables(path.read_text(), str(path)) == [a2, b]
    assert find_table("Test GPU 80GB", "b", 4, 64, tmp_path) == b
    assert find_table("Test GPU 80GB", "b", 8, 64, tmp_path) is None
    assert find_table("Other GPU", "b", 4, 64, tmp_path) is None


def test_merge_of_some_rows_keeps_the_others_and_both_records(tmp_path: Path) -> None:
    full = table({1: {4096: 4, 8192: 8}, 2: {4096: 2, 8192: 4}}, kernel="a")
    path = merge_table(full, tmp_path)
    merge_table(replace(table({1: {4096: 4, 8192: 9}}, kernel="a"), measured="again"), tmp_path)
    (got,) = parse_tables(path.read_text(), str(path))
    assert got.counts == {1: {4096: 4, 8192: 9}, 2: {4096: 2, 8192: 4}}
    assert got.measured == f"{full.measured}. Batch 1: again"
    # every batch size again: the whole table is replaced; one that drops measured rows or lengths
    # is refused unless asked for
    again = table({1: {4096: 4, 8192: 8}, 2: {4096: 3, 8192: 3}}, kernel="a")
    merge_table(again, tmp_path)
    assert parse_tables(path.read_text(), str(path)) == [again]
    # batch sizes it lacks, over the same lengths: added beside its rows
    merge_table(replace(table({3: {4096: 3, 8192: 2}}, kernel="a"), measured="more"), tmp_path)
    (got,) = parse_tables(path.read_text(), str(path))
    assert got.counts == again.counts | {3: {4096: 3, 8192: 2}}
    assert got.measured == f"{again.measured}. Batch 3: more"
    merge_table(again, tmp_path, replace_all=True)
    for fewer in (table({1: {4096: 5}}, kernel="a"), table({1: {4096: 4}, 3: {4096: 3}}, kernel="a")):
        with pytest.raises(ConfigError, match=r"would drop the measured batch sizes \[\d*\] and lengths"):
            merge_table(fewer, tmp_path)
        assert parse_tables(path.read_text(), str(path)) == [again]
        merge_table(fewer, tmp_path, replace_all=True)
        assert parse_tables(path.read_text(), str(path)) == [fewer]
        merge_table(again, tmp_path, replace_all=True)


def test_packaged_tables_parse_and_stay_within_the_minimum_split() -> None:
    from zerodram.kernels.attention import Fp2KernelConfig

    files = sorted(TABLE_DIR.glob("*.json"))
    assert files, "the H100's table ships with the package"
    for path in files:
        for t in parse_tables(path.read_text(), str(path)):
            assert device_file(t.device) == path
            # the key names a build this code makes (a renamed or dropped option orphans a table)
            assert Fp2KernelConfig.from_split_key(t.kernel).split_key() == t.kernel, (path, t.kernel)
            for row in t.counts.values():
                assert all(s <= Fp2DecodeAttention.most_count(n) for n, s in row.items()), path


def _sweep_row(B: int, L: int, times: dict[int, float], **extra) -> dict:
    row = {"device": "Test GPU 80GB", "split_key": "k", "Hkv": 8, "B": B, "L": L, **extra}
    return row | {f"fp2_ms_4x4x1-int8keys-quad-s{s}": ms for s, ms in times.items()}


def test_builder_takes_the_fewest_splits_within_the_margin(tmp_path: Path, capsys) -> None:
    """benchmarks/split_table.py: the median of each count over the rounds, then the fewest splits
    within --margin of the fastest; the wave model's count and time printed beside it."""
    mod = load_script("split_table")
    r1 = [
        _sweep_row(1, 4096, {2: 2.00, 4: 1.00, 8: 1.005}, wave_splits=8, plan_source="wave",
                   **{"fp2_ms_4x4x1-int8keys-quad": 1.2}),
        _sweep_row(8, 4096, {1: 3.0, 2: 1.0, 3: 0.9}, wave_splits=3),
    ]  # fmt: skip
    r2 = [_sweep_row(1, 4096, {2: 2.0, 4: 1.10, 8: 1.2}), _sweep_row(8, 4096, {1: 3.0, 2: 1.0, 3: 0.95})]
    best = mod.best_counts(r1 + r2, 0.01)
    assert best[(1, 4096)][:2] == (4, 1.05)  # medians: 4 -> 1.05, 8 -> 1.1025
    assert best[(8, 4096)][0] == 3
    files = []
    for i, rows in enumerate((r1, r2)):
        files.append(tmp_path / f"r{i}.jsonl")
        files[-1].write_text("# a comment line\n" + "".join(json.dumps(r) + "\n" for r in rows))
    args = ["x", *map(str, files), "--measured", "m", "--write", "--dir", str(tmp_path)]
    parser = __import__("argparse").ArgumentParser()
    mod.add_arguments(parser)
    assert mod.run(parser.parse_args(args[1:])) == 0
    out = capsys.readouterr().out
    # B = 1: the wave model's count is the untagged plan's time where the plan was the wave model's;
    # B = 8: its count (3) timed among the forced ones
    assert "  1    4096     4  1050.0     8  1200.0     1.143x" in out
    assert "  8    4096     3   925.0     3   925.0     1.000x" in out
    t = find_table("Test GPU 80GB", "k", 8, 64, tmp_path)
    assert t is not None and t.counts == {1: {4096: 4}, 8: {4096: 3}} and t.measured == "m"
    # one GPU and build only; a full grid only
    files[1].write_text(json.dumps(_sweep_row(8, 4096, {2: 1.0}, split_key="other")) + "\n")
    assert mod.run(parser.parse_args(args[1:])) == 2
    files[1].write_text(json.dumps(_sweep_row(8, 8192, {2: 1.0})) + "\n")
    assert mod.run(parser.parse_args(args[1:])) == 2
    assert "the grid must be full" in capsys.readouterr().err
    # one kernel variant a sweep (a row records one split_key), and no negative margin
    files[1].write_text(json.dumps(_sweep_row(8, 4096, {2: 1.0}) | {"fp2_ms_4x4x1-fp16keys-s2": 1.0}) + "\n")
    assert mod.run(parser.parse_args(args[1:])) == 2
    assert "one kernel variant" in capsys.readouterr().err
    files[1].write_text(json.dumps(_sweep_row(8, 4096, {2: 1.0})) + "\n")
    assert mod.run(parser.parse_args([*args[1:], "--margin", "-0.1"])) == 2


def test_builder_keys_the_table_on_the_rows_page_size(tmp_path: Path, capsys) -> None:
    """The rows' page size (`P`, benchmarks/attention.py --page-size; 64 where a row has none) keys
    the table, so the engine's pages of 32 find the one timed on them; rows of two sizes are refused."""
    mod = load_script("split_table")
    parser = __import__("argparse").ArgumentParser()
    mod.add_arguments(parser)
    rows = tmp_path / "r.jsonl"
    rows.write_text("".join(json.dumps(_sweep_row(b, 4096, {1: 2.0, 2: 1.0}, P=32)) + "\n" for b in (1, 2)))
    assert mod.run(parser.parse_args([str(rows), "--measured", "m", "--write", "--dir", str(tmp_path)])) == 0
    assert find_table("Test GPU 80GB", "k", 8, 64, tmp_path) is None
    assert find_table("Test GPU 80GB", "k", 8, 32, tmp_path).counts == {1: {4096: 2}, 2: {4096: 2}}
    # a grid that drops a measured length is refused, unless --replace
    rows.write_text(json.dumps(_sweep_row(1, 8192, {1: 1.0, 2: 2.0}, P=32)) + "\n")
    again = [str(rows), "--measured", "m2", "--write", "--dir", str(tmp_path)]
    assert mod.run(parser.parse_args(again)) == 2
    assert "would drop the measured batch sizes [2] and lengths [4096]" in capsys.readouterr().err
    assert mod.run(parser.parse_args([*again, "--replace"])) == 0
    assert find_table("Test GPU 80GB", "k", 8, 32, tmp_path).counts == {1: {8192: 1}}
    rows.write_text(json.dumps(_sweep_row(1, 4096, {2: 1.0}, P=32)) + "\n" + json.dumps(_sweep_row(2, 4096, {2: 1.0})) + "\n")
    assert mod.run(parser.parse_args([str(rows), "--measured", "m"])) == 2
    assert "page size" in capsys.readouterr().err


def test_builder_sweeps_then_builds(tmp_path: Path, monkeypatch, capsys) -> None:
    """`--sweep N --out DIR`: N rounds of benchmarks/attention.py, each a fresh process, the grid and
    counts reversed in every other, into DIR; then the table, with its record composed. A failed
    round (here the real script on a machine without a GPU) builds nothing."""
    import subprocess

    mod = load_script("split_table")
    parser = __import__("argparse").ArgumentParser()
    mod.add_arguments(parser)
    args = ["--sweep", "2", "--out", str(tmp_path / "sweep"), "--shape", "9x3x64", "--page-size", "32",
            "--batches", "1,2", "--lengths", "1024,2048", "--splits", "0,wave,1,2", "--write", "--dir", str(tmp_path)]  # fmt: skip
    cmds = mod.sweep_commands(parser.parse_args(args))
    assert [c[c.index("--batches") + 1 :] for c in cmds] == [
        ["1,2", "--lengths", "1024,2048", "--splits", "0,wave,1,2"],
        ["2,1", "--lengths", "2048,1024", "--splits", "2,1,wave,0"],
    ]
    assert cmds[0][2:9] == ["--json", "--no-fp16", "--no-defer", "--reps", "20", "--shape", "9x3x64"]
    if not __import__("torch").cuda.is_available():  # the real benchmark refuses: no table
        assert mod.run(parser.parse_args(args)) == 2
        assert "round 1 failed (exit 2" in capsys.readouterr().err
        assert find_table("Test GPU 80GB", "k", 8, 32, tmp_path) is None
    real_run = subprocess.run

    def fake_run(cmd, *a, **kw):
        if cmd[1].endswith("attention.py"):  # a round: rows as the benchmark prints them
            kw["stdout"].write("".join(json.dumps(_sweep_row(b, n, {1: 2.0, 2: 1.0}, P=32)) + "\n" for b in (1, 2) for n in (1024, 2048)))
            return subprocess.CompletedProcess(cmd, 0)
        if cmd[0] == "nvidia-smi":
            return subprocess.CompletedProcess(cmd, 0, stdout="580.159.04\n")
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert mod.run(parser.parse_args(args)) == 0
    t = find_table("Test GPU 80GB", "k", 8, 32, tmp_path)
    assert t is not None and t.counts == {1: {1024: 2, 2048: 2}, 2: {1024: 2, 2048: 2}}
    assert t.measured.startswith(f"{__import__('datetime').date.today()}, Test GPU 80GB (driver 580.159.04), tree ")
    assert "2 rounds" in t.measured and "--page-size 32" in t.measured and str(tmp_path / "sweep") in t.measured
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["round1.jsonl", "round2.jsonl"]
    # --sweep takes --out and no files; without it, files and --measured
    assert mod.run(parser.parse_args(["--sweep", "2"])) == 2
    assert mod.run(parser.parse_args([str(tmp_path / "sweep" / "round1.jsonl")])) == 2
    assert "--measured" in capsys.readouterr().err


def test_split_key_reads_back_and_refuses_what_no_build_makes() -> None:
    from zerodram.kernels.attention import Fp2KernelConfig

    for cfg in (Fp2KernelConfig(), Fp2KernelConfig(64, 3, 32, 16, "e8m0", 8, 2, 2, False, v_quad=True)):
        assert Fp2KernelConfig.from_split_key(cfg.split_key()) == cfg
    key = Fp2KernelConfig(key_s8=True, v_quad=True).split_key()
    for bad in (
        "head_dim64-r255u8", key.replace("stages4", "stage4"), key.replace("r255", "r2x5"),
        key.replace("scale_fmt0", "scale_fmt7"), key.replace("key_s81", "key_s82"), key + "-x1", "junk",
    ):  # fmt: skip
        with pytest.raises(ValueError, match="split key"):
            Fp2KernelConfig.from_split_key(bad)
