"""`zerodram bench attention-timeline` on CPU: its summary of per-CTA stamps, on stamps built so that
every figure is known, and its refusal without a GPU (the timeline build of the decode kernel
compiles in tests/test_attention.py; its stamps are read on the GPU machine)."""

from __future__ import annotations

import json

from bench_cli import assert_refuses_without_gpu, load_script, run_bench


def test_summary_of_known_stamps() -> None:
    mod = load_script("attention_timeline")
    us = 1000  # stamps are nanoseconds
    t0 = 5_000_000
    # [start, first stage, loop end, partial, done, SM, kind, stages, count, ...]; split i: loop of
    # 10 * (i + 1) us
    splits = [[t0 + i * us, t0 + (i + 4) * us, t0 + (i + 4 + 10 * (i + 1)) * us, 0, 0, i, 1, 0, 0, 0, 0, 0] for i in range(3)]
    for r in splits:
        r[3] = r[2] + 1 * us
        r[4] = r[3] + 2 * us
    bf16 = [t0 + 1 * us, 0, 0, t0 + 9 * us, t0 + 10 * us, 7, 2, 0, 0, 0, 0, 0]
    empty = [t0 - 50 * us, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0]  # a split without work: its start still counts for t0
    m = mod.summarize([*splits, bf16, empty])
    assert m["span: main loop"] == (10.0, 20.0, 30.0)
    assert m["span: prologue"] == (4.0, 4.0, 4.0)
    assert m["span: combine"] == (1.0, 1.0, 1.0)
    assert m["span: count and merge"] == (1.0, 2.0, 2.0)  # the bf16 CTA's 1 us and the splits' 2 us
    assert m["split start"] == (50.0, 51.0, 52.0)
    assert m["bf16 partial written"] == (59.0, 59.0, 59.0)
    assert m["last done"][0] == 50 + 2 + 4 + 30 + 1 + 2


def test_merge_apart_from_the_count() -> None:
    """Two rows of two splits and a bf16 CTA each, in grid order; the CTA that finishes a row last
    merged it: its span is the merge's, the others' the count's."""
    mod = load_script("attention_timeline")
    us = 1000

    def cta(kind: int, partial: int, done: int) -> list[int]:
        # the merge's own stamps 1, 1 + 2 and 1 + 2 + 3 us after the partial (read for the last CTAs)
        return [0, us, 2 * us, partial * us, done * us, 0, kind, 0, *((partial + d) * us for d in (1, 3, 6)), 0]

    # splits of row 0, of row 1, then the bf16 CTAs of rows 0 and 1; row 1's bf16 CTA merges
    stamps = [cta(1, 10, 11), cta(1, 12, 19), cta(1, 10, 12), cta(1, 11, 12), cta(2, 5, 6), cta(2, 13, 20)]
    m = mod.summarize(stamps, num_splits=2)
    assert m["span: count, merge (last of row)"] == (7.0, 7.0, 7.0)  # 12 -> 19 and 13 -> 20
    assert m["span: count only"] == (1.0, 1.0, 2.0)  # 1, 1, 2, 1
    assert m["merge: count"] == (1.0, 1.0, 1.0)
    assert m["merge: (m, l), early partials landed"] == (2.0, 2.0, 2.0)
    assert m["merge: early partials summed"] == (3.0, 3.0, 3.0)
    assert m["merge: the other partials, out"] == (1.0, 1.0, 1.0)  # 7 us in all
    assert not any(k.startswith("merge:") or "count only" in k for k in mod.summarize(stamps))


def _placed_stamps() -> list[list[int]]:
    """Three rows of three splits (each row's last split short: 4 stages against 8) and their bf16
    CTAs, in grid order; SM and loop time (us) chosen so that every by-SM figure is known. Split
    CTAs by SM: SM 0: 20, 24 (and row 0's bf16 CTA); SM 1: 22, 30; SM 2: the short 10 and 11;
    SM 3: the short 12 and 26 (and row 1's bf16 CTA); SM 4: 40 alone. Row 2's bf16 CTA is on SM 5."""
    us = 1000

    def cta(kind: int, sm: int, loop: int, stages: int = 8) -> list[int]:
        return [0, us, (1 + loop) * us, 0, 0, sm, kind, stages, 0, 0, 0, 0]

    return [cta(1, 0, 20), cta(1, 1, 22), cta(1, 2, 10, 4),  # row 0
            cta(1, 1, 30), cta(1, 0, 24), cta(1, 3, 12, 4),  # row 1
            cta(1, 4, 40), cta(1, 3, 26), cta(1, 2, 11, 4),  # row 2
            cta(2, 0, 0), cta(2, 3, 0), cta(2, 5, 0)]  # fmt: skip


def test_by_sm_of_known_stamps() -> None:
    mod = load_script("attention_timeline")
    held, f, in_order = mod.by_sm(_placed_stamps(), num_splits=3)
    assert held == {2: 4, 1: 1}
    assert in_order == (2, 2)  # SM 0: 20 then 24, SM 1: 22 then 30 (SMs 2 and 3 hold short splits)
    swapped = _placed_stamps()
    swapped[1][2], swapped[3][2] = swapped[3][2], swapped[1][2]  # SM 1: 30 then 22
    assert mod.by_sm(swapped, num_splits=3)[2] == (1, 2)
    assert f["loop, on SMs holding 2 split CTAs"] == (20.0, 24.0, 30.0)  # 20, 24, 22, 30, 26: short ones out
    assert f["loop, on SMs holding 1 split CTAs"] == (40.0, 40.0, 40.0)  # alone: not a short split
    assert f["loop, SM also ran a bf16 CTA"] == (20.0, 24.0, 26.0)  # SMs 0 and 3
    assert f["loop, no bf16 CTA on its SM"] == (22.0, 30.0, 40.0)  # SMs 1, 2 (short only) and 4
    assert f["loop, apart within an SM"] == (4.0, 6.0, 8.0)  # SM 0: 4, SM 1: 8; a true median
    assert f["loop, mean of each SM"] == (22.0, 26.0, 40.0)  # 22, 26, 26, 40
    assert f["loop, mean of each SM holding 2"] == (22.0, 26.0, 26.0)  # SM 2 holds only short splits
    assert f["loop, mean of each SM holding 1"] == (40.0, 40.0, 40.0)
    assert f["loop, short splits"] == (10.0, 11.0, 12.0)
    assert f["loop, split CTA 1 of its SM in grid order"] == (20.0, 22.0, 40.0)  # SMs 0, 1, 4 (2, 3: short)
    assert f["loop, split CTA 2 of its SM in grid order"] == (24.0, 26.0, 30.0)  # SMs 0, 1, 3 (2: short)
    assert "loop, alone on its SM" not in f  # the holding-1 figure above is that


def test_from_raw_needs_no_gpu(tmp_path) -> None:
    """--from-raw prints both summaries of a --raw file's case, with or without a GPU."""
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"B": 3, "L": 4096, "splits": 3, "stamps": _placed_stamps()}) + "\n\n")  # a blank line too
    r = run_bench(["attention-timeline", "--from-raw", str(raw)])
    assert r.returncode == 0, r.stderr
    assert "B = 3, L = 4096: 3 splits per row, CTAs on 6 SMs" in r.stdout
    assert "split CTAs an SM held 1: 1 SMs, 2: 4 SMs" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "loop, apart within an SM" in x)
    assert line.split()[-3:] == ["4.00", "6.00", "8.00"]
    assert "later in grid order, longer loop on 2 of 2 SMs" in r.stdout


def test_refuses_without_a_gpu() -> None:
    assert_refuses_without_gpu("attention-timeline")
