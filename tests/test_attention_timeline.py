"""`zerodram bench attention-timeline` on CPU: its summary of per-CTA stamps, on stamps built so that
every figure is known, and its refusal without a GPU (the timeline build of the decode kernel
compiles in tests/test_attention.py; its stamps are read on the GPU machine)."""

from __future__ import annotations

from bench_cli import assert_refuses_without_gpu, load_script


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


def test_refuses_without_a_gpu() -> None:
    assert_refuses_without_gpu("attention-timeline")
