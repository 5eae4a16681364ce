"""Decode attention per CTA: when each CTA of the FP2 decode kernel starts, has its first stage,
ends its main loop, writes its partial and finishes (a probe for load balance and fixed costs).

    python benchmarks/attention_timeline.py [--json] [--batches 1,8] [--lengths 8192,131072]
    zerodram bench attention-timeline ...

A timeline build of the kernel (`Fp2DecodeAttention(timeline=True)`: thread 0 of every CTA stamps
%globaltimer at fixed points, kernels/cuda/attn_fp2_decode.cu) runs one call after three warm-up
calls and an L2 flush (a 256 MB read), eagerly. For the split CTAs with work the table gives the
min / median / max of each mark, in microseconds after the first CTA's start, and of the spans
between marks; for the bf16 CTAs their start and end. The stamps add a few instructions per CTA,
none in the main loop. Shapes as benchmarks/attention.py: Hq 32, Hkv 8, D 128, page 64, 36 bf16
tokens per sequence, int8 keys, quad values. docs/fp2-kernel.md, "Where it stands after the
one-launch kernel", has what a run showed.

By SM (`by_sm`, printed after the marks): how many split CTAs each SM held, and the split CTAs' loop
times set against where they ran: beside a bf16 CTA or not, the spread inside one SM and across
SMs, by how many split CTAs the SM held (one: the split CTAs alone on their SM), and the short
splits (the rows' last, holding the remainder); the JSON line has them as `by_sm_us` and
`split_ctas_held`. `--raw` keeps every CTA's stamps; `--from-raw FILE` prints both summaries from such a file, without a GPU.

`--warm-code`: after the flush, one call of the same kernel on one sequence of two of the layer's
pages, so that the timed call finds the kernel's code in L2 while its pages stay in DRAM. Set
against a run without it, the prologue's difference is what fetching the code from DRAM costs (the
flush evicts it too).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from zerodram.runtime.argtypes import int_list

HQ, HKV, D, P, HP = 32, 8, 128, 64, 36
SPLIT_WITH_WORK, BF16_CTA = 1, 2  # timeline column 6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int_list, default="1,8")
    p.add_argument("--lengths", type=int_list, default="8192,131072")
    p.add_argument("--json", action="store_true", help="one JSON line per case")
    p.add_argument("--raw", metavar="PATH", help="also write every CTA's stamp row, one JSON line per case")
    p.add_argument("--from-raw", metavar="PATH", help="summarize a --raw file's cases instead (no GPU needed)")
    p.add_argument("--warm-code", action="store_true", help="fetch the kernel's code into L2 after the flush")


def _spread(values: list[float], *, upper: bool) -> tuple[float, float, float]:
    """(min, median, max) of `values`, NaNs when empty; `upper`: the upper of the middle two of an
    even count (summarize's marks keep it), else their mean."""
    v = sorted(values)
    if not v:
        return (math.nan, math.nan, math.nan)
    return (v[0], v[len(v) // 2] if upper else statistics.median(v), v[-1])


def summarize(stamps: list[list[int]], num_splits: int | None = None) -> dict[str, tuple[float, float, float]]:
    """(min, median, max) in microseconds of each mark and span over the CTAs' stamp rows
    [start, first stage, loop end, partial, finish, SM, kind, stages of warp 0, count done, (m, l)
    and early partials in, early partials summed, unused] (ns, kernel layout).
    Given `num_splits`, with the stamps in grid order (split i % S of row i // S for i < S * rows,
    then a bf16 CTA per row), the count apart from the merge: partial to finish of the CTAs that
    only counted, and of each row's last CTA, which also merged, with the parts of its merge."""
    t0 = min(r[0] for r in stamps)
    splits = [r for r in stamps if r[6] == SPLIT_WITH_WORK]
    bf16 = [r for r in stamps if r[6] == BF16_CTA]
    merged: list[list[int]] = []
    counted: list[list[int]] = []
    if num_splits is not None:
        fp2_ctas = len(stamps) // (num_splits + 1) * num_splits
        by_row: dict[int, list[list[int]]] = {}
        for i, r in enumerate(stamps):
            if r[6] in (SPLIT_WITH_WORK, BF16_CTA):
                by_row.setdefault(i // num_splits if i < fp2_ctas else i - fp2_ctas, []).append(r)
        for ctas in by_row.values():
            last = max(ctas, key=lambda r: r[4])
            merged.append(last)
            counted += [r for r in ctas if r is not last]

    def stats(values: list[float]) -> tuple[float, float, float]:
        return _spread(values, upper=True)

    rows = {
        "split start": [r[0] - t0 for r in splits],
        "split first stage": [r[1] - t0 for r in splits],
        "split loop end": [r[2] - t0 for r in splits],
        "split partial written": [r[3] - t0 for r in splits],
        "split done": [r[4] - t0 for r in splits],
        "span: prologue": [r[1] - r[0] for r in splits],
        "span: main loop": [r[2] - r[1] for r in splits],
        "span: combine": [r[3] - r[2] for r in splits],
        "span: count and merge": [r[4] - r[3] for r in splits + bf16],
        "span: count only": [r[4] - r[3] for r in counted],
        "span: count, merge (last of row)": [r[4] - r[3] for r in merged],
        "bf16 start": [r[0] - t0 for r in bf16],
        "bf16 partial written": [r[3] - t0 for r in bf16],
        "last done": [max(r[4] for r in splits + bf16) - t0],
    }
    rows |= {  # inside each row's merge (its last CTA), by the stamps finish_row makes
        "merge: count": [r[8] - r[3] for r in merged],
        "merge: (m, l), early partials landed": [r[9] - r[8] for r in merged],
        "merge: early partials summed": [r[10] - r[9] for r in merged],
        "merge: the other partials, out": [r[4] - r[10] for r in merged],
    }
    if num_splits is None:
        for k in [k for k in rows if "(last of row)" in k or k.startswith("merge:")] + ["span: count only"]:
            del rows[k]
    return {k: tuple(x / 1e3 for x in stats(v)) for k, v in rows.items()}


def by_sm(
    stamps: list[list[int]], num_splits: int
) -> tuple[dict[int, int], dict[str, tuple[float, float, float]], tuple[int, int]]:
    """Where the split CTAs' loops ran, over stamp rows in grid order (as `summarize` reads them):
    ({split CTAs an SM held: SMs}, {figure: (min, median, max) us}, (k, n)): of the n SMs holding
    two or more split CTAs, none of them short, k had each CTA's loop no shorter than the one
    before it in grid order. Loop times are "span: main loop". Short splits (warp 0 with fewer
    stages than the most: the rows' last splits, holding the remainder of the range) have a figure
    of their own and are left out of every other. Medians are true medians (the mean of the middle
    two of an even count), not `summarize`'s upper ones: these groups can be small."""
    fp2_ctas = len(stamps) // (num_splits + 1) * num_splits
    loop: dict[int, float] = {}
    splits_on: dict[int, list[int]] = {}
    bf16_sms = set()
    for i, r in enumerate(stamps):
        if i < fp2_ctas and r[6] == SPLIT_WITH_WORK:
            loop[i] = (r[2] - r[1]) / 1e3
            splits_on.setdefault(r[5], []).append(i)
        elif i >= fp2_ctas and r[6] == BF16_CTA:
            bf16_sms.add(r[5])
    most = max((stamps[i][7] for i in loop), default=0)
    short = {i for i in loop if stamps[i][7] < most}

    def stats(values: list[float]) -> tuple[float, float, float]:
        return _spread(values, upper=False)

    full = {sm: [loop[i] for i in ids if i not in short] for sm, ids in splits_on.items()}
    held: dict[int, int] = {}
    for ids in splits_on.values():
        held[len(ids)] = held.get(len(ids), 0) + 1
    figures = {}
    for n in sorted(held):
        on = [v for sm, v in full.items() if len(splits_on[sm]) == n]
        figures[f"loop, on SMs holding {n} split CTAs"] = stats([t for v in on for t in v])
        figures[f"loop, mean of each SM holding {n}"] = stats([sum(v) / len(v) for v in on if v])
    # By a CTA's place among its SM's split CTAs in grid order (the order the CTAs were dispatched
    # in, so the age of their warps): on both the H100 and the H200 an SM's equal split CTAs loop
    # longer down that order (stop 52, docs/benchmarks.md).
    ranked: dict[int, list[float]] = {}
    for ids in splits_on.values():
        for k, i in enumerate(ids):
            if i not in short:
                ranked.setdefault(k, []).append(loop[i])
    for k in sorted(ranked):
        figures[f"loop, split CTA {k + 1} of its SM in grid order"] = stats(ranked[k])
    whole = [v for sm, v in full.items() if len(v) == len(splits_on[sm]) > 1]  # two or more, none short
    in_order = (sum(v == sorted(v) for v in whole), len(whole))
    return held, figures | {
        "loop, SM also ran a bf16 CTA": stats([t for sm, v in full.items() if sm in bf16_sms for t in v]),
        "loop, no bf16 CTA on its SM": stats([t for sm, v in full.items() if sm not in bf16_sms for t in v]),
        "loop, apart within an SM": stats([max(v) - min(v) for v in full.values() if len(v) > 1]),
        "loop, mean of each SM": stats([sum(v) / len(v) for v in full.values() if v]),
        "loop, short splits": stats([loop[i] for i in short]),
    }, in_order


def _print_case(title: str, stamps: list[list[int]], splits: int) -> tuple[dict, dict, dict, tuple[int, int]]:
    """Print the marks and the by-SM figures of one case; (marks, by-SM figures, SMs by held, SMs
    whose loops grew down the grid order)."""
    marks, sms = summarize(stamps, splits), len({r[5] for r in stamps})
    held, placed, in_order = by_sm(stamps, splits)
    print(f"\n# {title}: {splits} splits per row, CTAs on {sms} SMs; us (min / median / max)")
    width = max(map(len, [*marks, *placed]))
    for k, (lo, mid, hi) in [*marks.items(), *placed.items()]:
        print(f"{k:>{width}} {lo:9.2f} {mid:9.2f} {hi:9.2f}")
    print(f"{'split CTAs an SM held':>{width}} " + ", ".join(f"{c}: {held[c]} SMs" for c in sorted(held)))
    print(f"{'later in grid order, longer loop':>{width}} on {in_order[0]} of {in_order[1]} SMs holding two or more (none short)")
    return marks, placed, held, in_order


def _case(B: int, L: int, flush, warm_code: bool = False) -> tuple[list[list[int]], int]:
    import torch

    from zerodram.runtime.attention import (
        Fp2DecodeAttention,
        random_decode_batch,
        random_fp2_layer,
    )

    gen = torch.Generator(device="cuda").manual_seed(B * 7 + L)
    pages = B * math.ceil(L / P)
    layer = random_fp2_layer(pages, HKV, P, D, device="cuda", generator=gen, v_layout="quad")
    batch = random_decode_batch([L] * B, [HP] * B, pages, HKV, P, D, hp_max=HP, device="cuda", generator=gen)
    q = torch.randn(B, HQ, D, device="cuda", generator=gen)
    att = Fp2DecodeAttention(
        num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P, max_batch=B, max_fp2_tokens=L,
        device="cuda", v_layout="quad", timeline=True,
    )  # fmt: skip
    # --warm-code's call: one sequence over two of the layer's pages (its code, not the case's data)
    small = random_decode_batch([2 * P], [HP], pages, HKV, P, D, hp_max=HP, device="cuda", generator=gen)
    for _ in range(3):
        att(q, layer, batch, max_len=L)
    assert att.timeline is not None
    flush.sum()
    if warm_code:
        att(q[:1], layer, small, max_len=2 * P)
    att.timeline.zero_()  # after the warm call: its stamps would land in the same rows
    att(q, layer, batch, max_len=L)
    torch.cuda.synchronize()
    splits = att.plan(B, L)[0]
    stamps = att.timeline[: (splits + 1) * HKV * B].tolist()
    return stamps, splits


def run(args: argparse.Namespace) -> int:
    if args.from_raw:
        with open(args.from_raw) as f:
            for line in f:
                if not line.strip():
                    continue
                c = json.loads(line)
                _print_case(f"{args.from_raw}, B = {c['B']}, L = {c['L']}", c["stamps"], c["splits"])
        return 0
    import torch

    if not torch.cuda.is_available():
        print("attention_timeline needs a CUDA GPU", file=sys.stderr)
        return 2
    flush = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB, read before the call
    name = torch.cuda.get_device_name()
    for B in args.batches:
        for L in args.lengths:
            stamps, splits = _case(B, L, flush, args.warm_code)
            if args.raw:
                with open(args.raw, "a") as f:  # rows as summarize() reads them
                    f.write(json.dumps({"B": B, "L": L, "splits": splits, "stamps": stamps}) + "\n")
            title = f"{name}, B = {B}, L = {L}" + (", code warm" if args.warm_code else "")
            marks, placed, held, in_order = _print_case(title, stamps, splits)
            if args.json:
                print(json.dumps({"bench": "attention_timeline", "device": name, "B": B, "L": L, "splits": splits,
                                  "warm_code": args.warm_code, "marks_us": marks,
                                  "by_sm_us": {k: None if math.isnan(v[1]) else v for k, v in placed.items()},
                                  "split_ctas_held": held, "sms_later_longer": in_order}))  # fmt: skip
    return 0



if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
