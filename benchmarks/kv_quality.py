"""KV-cache quality table (docs/kv-quality.md): every format on a real model, one command.

    python benchmarks/kv_quality.py                  # measure what is missing, then write the doc
    python benchmarks/kv_quality.py --render-only    # rewrite the doc from the stored results
    zerodram bench kv-quality ...

Each row is one `zerodram eval-kv` measurement (runtime/kv_eval/run.py) on SmolLM2-135M with the
pydoc text: teacher-forced perplexity over `--windows` windows of `ctx` tokens from token 0, the
full-precision (fp32) cache on the same tokens as reference, the attention-output error, and the
passkey check at the model's limit. Results are appended as JSON lines to
benchmarks/results/kv_quality.jsonl, each stamped with date and machine; a row already there
(same kv, ctx, windows, needle settings) is not measured again unless --fresh. The doc's tables sit
between `<!-- kv-quality:CTX -->` markers and are rewritten from that file; the prose around them
is written by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kv_quality.jsonl"
DOC = ROOT / "docs" / "kv-quality.md"


@dataclass(frozen=True)
class Row:
    """One line of the table: a label, a `--kv` spec, and at which contexts it is measured."""

    label: str
    kv: str
    contexts: tuple[int, ...] = (2048,)


# The FP2 default (runtime/kv/format.py DEFAULT_FP2) is chosen on the development split
# (windows 4-5), never on the windows reported here.
ROWS: list[Row] = [
    # references and baselines
    Row("BF16", "bf16", (2048, 8192)),
    Row("FP8 e4m3 (static scale 1)", "fp8"),
    Row("INT4 per token, g32, asymmetric", "int4", (2048, 8192)),
    Row("INT3 per token, g32, asymmetric", "int3"),
    Row(
        "KIVI-2: K per channel (32 tokens), V per token (32 ch), 128 recent fp16 (flushed 128 at a time)",
        "kivi2",
        (2048, 8192),
    ),
    Row(
        "KIVI-2, sliding: >= 96 recent fp16, flushed 32 at a time (same 127 fp16 rows)",
        "kivi2:recent=32,window=96",
    ),
    Row("INT2 per token, g64", "int2:g=64"),
    Row("INT2 per token, g32", "int2"),
    # FP2, signature lattice {-3, -0.5, 0.5, 3}
    Row(
        "FP2 sig. lattice, absmax, blocks c32 (bf16 scale), no rotation, no sinks / tail",
        "fp2:levels=sig,rule=absmax,rot=0,blk=c32,scale=bf16,sinks=0,tail=1",
    ),
    Row("FP2 sig. lattice, absmax, c64 e4m3, rotation, 4 sinks + 32 tail", "fp2:levels=sig,rule=absmax"),
    Row("FP2 sig. lattice, MSE scale search (best rule), c64, rotation, 4 + 32", "fp2:levels=sig"),
    # the first calibration's recipe, step by step (shared/notes/kv-calibration.md): bf16 scales, c32
    Row(
        "note: sig. lattice, c32, MSE scale search, no rotation, no sinks / tail",
        "fp2:levels=sig,rot=0,blk=c32,scale=bf16,sinks=0,tail=1",
    ),
    Row("note: + Hadamard rotation", "fp2:levels=sig,blk=c32,scale=bf16,sinks=0,tail=1"),
    Row(
        "note: + 4 sinks and 32 recent tokens in bf16",
        "fp2:levels=sig,blk=c32,scale=bf16,sinks=4,tail=1,window=32",
    ),
    Row("note: + Lloyd-Max levels (the note's best)", "fp2:blk=c32,scale=bf16,sinks=4,tail=1,window=32"),
    Row("note: best with E8M0 scales", "fp2:blk=c32,scale=e8m0,sinks=4,tail=1,window=32"),
    # FP2, other levels and options (bare `fp2`: Lloyd-Max levels, MSE rule, c64 e4m3, rotation, 4 + 32)
    Row("FP2 Lloyd-Max levels (bare `fp2`: calibration-free, what the kernels read)", "fp2", (2048, 8192)),
    Row("FP2 calibrated levels (per layer and side)", "fp2:levels=cal"),
    Row("FP2 without rotation", "fp2:rot=0"),
    Row("FP2 RMS scale rule", "fp2:rule=rms"),
    Row("FP2 E8M0 (power-of-two) scales", "fp2:scale=e8m0"),
    Row("FP2 blocks of 32 channels", "fp2:blk=c32"),
    Row("FP2 blocks of 16 channels", "fp2:blk=c16"),
    Row("FP2 score anchor on K", "fp2:kanchor=score"),
    Row("FP2 pre-RoPE K per channel (token blocks of 32), no K rotation", "fp2:kprerope=1,kblk=t32,krot=0"),
    Row("FP2 + 0.5% sparse K outliers", "fp2:kout=0.005"),
    Row("FP2 + K centered (calibrated mean, free for keys)", "fp2:kcenter=1"),
    Row("FP2 + K error-feedback rounding", "fp2:kfb=1"),
    Row("FP2 + K centered + K error feedback", "fp2:kcenter=1,kfb=1"),
    Row("FP2 + pre-RoPE K centered + K error feedback", "fp2:kprerope=1,kcenter=1,kfb=1"),
    # FP2 with a bf16 window of recent tokens (same bits: smaller flushes)
    Row("FP2, window 32 + flush 16 (calibration-free)", "fp2:tail=16,window=32"),
    Row("FP2, K error feedback, window 32 + flush 16", "fp2:kfb=1,tail=16,window=32"),
    Row("FP2, K error feedback, window 40 + flush 8", "fp2:kfb=1,tail=8,window=40"),
    Row(
        "**FP2 default**: K and V error feedback, window 47 + flush 1",
        "fp2:fb=1,tail=1,window=47",
        (2048, 8192),
    ),
    Row("FP2 default with the signature lattice", "fp2:fb=1,tail=1,window=47,levels=sig"),
    Row("FP2 default, K error feedback only", "fp2:kfb=1,tail=1,window=47"),
    Row("FP2 default without error feedback", "fp2:tail=1,window=47"),
    Row("FP2 default, feedback in blocks of 32 channels", "fp2:fb=1,fbblk=32,tail=1,window=47"),
    Row("FP2 default + pre-RoPE K centered (harness only)", "fp2:kprerope=1,kcenter=1,fb=1,tail=1,window=47"),
    # the bits / quality frontier: larger bf16 windows
    Row("FP2 default with window 79", "fp2:fb=1,tail=1,window=79"),
    Row("FP2 default with window 111", "fp2:fb=1,tail=1,window=111"),
]


def _machine() -> str:
    import torch

    return f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}"


def _key(d: dict) -> tuple:
    return (
        d["kv"],
        d["ctx"],
        d["num_windows"],
        d.get("first_window", 0),
        d["needle_ctx"],
        d["needle_trials"],
    )


def load_results(path: Path = RESULTS) -> list[dict]:
    """Stored results, later lines replacing earlier ones with the same key."""
    if not path.exists():
        return []
    out: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out[_key(d)] = d
    return list(out.values())


def measure(args: argparse.Namespace, rows: list[Row]) -> None:
    import torch

    from zerodram.runtime.kv_eval.run import Evaluator

    torch.set_num_threads(args.threads)
    have = {_key(d) for d in load_results()} if not args.fresh else set()
    ev = None
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    for ctx in args.ctx:
        for row in rows:
            if ctx not in row.contexts:
                continue
            needle_ctx = args.needle_ctx if ctx == max(args.ctx) else 0
            key = (row.kv, ctx, args.windows, 0, needle_ctx, args.needle_trials if needle_ctx else 0)
            if key in have:
                continue
            if ev is None:
                ev = Evaluator(args.model, args.text)
            res = ev.run(
                row.kv,
                ctx=ctx,
                num_windows=args.windows,
                needle_ctx=needle_ctx,
                needle_trials=args.needle_trials,
            )
            d = res.as_dict() | {
                "label": row.label,
                "date": datetime.date.today().isoformat(),
                "machine": _machine(),
            }
            with RESULTS.open("a") as f:
                f.write(json.dumps(d) + "\n")
            print(json.dumps(d), flush=True)


def _fmt_needle(d: dict) -> str:
    if d.get("needle_pass_rate") is None:
        return "-"
    n = d["needle_trials"]
    return f"{round(d['needle_pass_rate'] * n)}/{n} (ref {round(d['needle_pass_rate_ref'] * n)}/{n})"


def render_table(results: list[dict], ctx: int, rows: list[Row]) -> str:
    """Markdown table of the stored results at one context, in `rows` order."""
    by_kv: dict[str, dict] = {}
    for d in results:
        if d["ctx"] == ctx and d.get("first_window", 0) == 0:
            by_kv[d["kv"]] = d
    lines = [
        "| scheme | `--kv` | bits/elem | PPL | ΔPPL | rel. ΔPPL | attn-out rel. err | needle |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    stamp = set()
    for row in rows:
        d = by_kv.get(row.kv)
        if d is None or ctx not in row.contexts:
            continue
        stamp.add((d["date"], d["machine"], d["num_windows"], d["num_scored"], d["ppl_ref"]))
        lines.append(
            f"| {row.label} | `{row.kv}` | {d['bits_per_elem']:.3f} | {d['ppl']:.3f} | {d['delta_ppl']:+.3f} | "
            f"{d['rel_delta_ppl'] * 100:+.2f}% | {d['attn_rel_err']:.4f} | {_fmt_needle(d)} |"
        )
    if len(lines) == 2:
        return "(not measured)"
    foot = "; ".join(
        f"{date}, {machine}: {nw} windows, {ns} tokens scored, fp32 reference PPL {ref:.4f}"
        for date, machine, nw, ns, ref in sorted(stamp)
    )
    return "\n".join(lines) + f"\n\nMeasured {foot}."


def render_doc(results: list[dict], rows: list[Row]) -> None:
    """Rewrite every `<!-- kv-quality:CTX -->` ... `<!-- /kv-quality -->` block of the doc."""
    text = DOC.read_text()

    def block(m: re.Match) -> str:
        ctx = int(m.group(1))
        return f"<!-- kv-quality:{ctx} -->\n{render_table(results, ctx, rows)}\n<!-- /kv-quality -->"

    new = re.sub(r"<!-- kv-quality:(\d+) -->.*?<!-- /kv-quality -->", block, text, flags=re.S)
    DOC.write_text(new)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", default="pydoc")
    p.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192], help="contexts (default 2048 8192)")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--needle-ctx", type=int, default=8192, help="passkey length, run with the longest ctx")
    p.add_argument("--needle-trials", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--only", action="append", default=[], metavar="KV", help="restrict to these --kv specs (repeat)"
    )
    p.add_argument("--fresh", action="store_true", help="measure again rows already stored")
    p.add_argument("--render-only", action="store_true", help="only rewrite docs/kv-quality.md")


def run(args: argparse.Namespace) -> int:
    rows = ROWS
    if args.only:
        unknown = set(args.only) - {r.kv for r in ROWS}
        if unknown:
            raise SystemExit(f"--only: not rows of the table: {sorted(unknown)}")
        rows = [r for r in ROWS if r.kv in args.only]
    if not args.render_only:
        measure(args, rows)
    render_doc(load_results(), ROWS)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
