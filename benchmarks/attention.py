"""Decode attention: fused FP2 kernels vs FP16 SDPA (GQA), bytes read, bandwidth, speedup.

    python benchmarks/attention.py [--json] [--batches 1,8,32] [--lengths 8192,32768,131072]
    python benchmarks/attention.py --batches 8 --lengths 8192 --splits 0,2,3,4,5,6,8 --no-fp16
    zerodram bench attention ...

Shape legend: B seqs, L context (FP2 tokens; plus 36 bf16 sink/tail tokens), Hq = 32 query heads,
Hkv = 8 kv heads, D = 128 (`--shape HQxHKVxD`: another model's, e.g. to build its split table),
P = 64 page size (`--page-size`: the engine's is 32).

Timing: each launch sequence is captured once in a CUDA graph (as the engine's decode step runs)
and replayed; CUDA events around each replay, a 256 MB L2 flush (a read) before every repetition, warm-up,
0.2 s of idle, medians; a variant's split counts with their repetitions interleaved, so each count
sees the same GPU. The same for the FP16 baseline. FP2 = the one decode kernel (q scaling, the bf16 tokens and
the merge included; the [D, D] rotations of q and the output are not, see docs/benchmarks.md). FP16 = `F.scaled_dot_product_attention(q, k, v,
enable_gqa=True)` on contiguous [B, H, L, D] tensors (no paging). torch has no FP8-KV attention
path (SDPA rejects float8 inputs), so none is timed. Also times the write kernel: one token per
sequence (decode append) and a 32-token tail flush per sequence, alone, and the append's added
time when it runs in one graph with the decode (`write1_added_ms`: the cost a decode step sees);
and the engine's own append in the default format or `--write-kv`'s (`ewrite1_ms`,
`ewrite1_added_ms`, the format in `write_kv`: its bf16 window, the new token rounded with error
feedback into its page row, kernels/kv_write.py; `--write-kv fp2:fb=1,fbblk=32,tail=1,window=47`
times feedback blocks), also
deferred as the engine's captured steps make it, after the decode that attends its tokens, on a
low-priority stream (`defer1_added_ms`: per layer of four in one graph, over plain decodes;
`defer16_added_ms`: per layer of sixteen; `defer_steady_added_ms`: what each layer past the fourth
adds, the step's last write counted in neither; `defer1_alone_added_ms`: one layer, joined right
after; `--no-defer` skips them).

The plan's split count (`plan_splits`) comes from the GPU's measured split table where one covers
the case (`plan_source`: table; runtime/attention/split_table.py), else from the wave model
(`wave_splits`; `--splits 0,wave` times both). `split_key` names the kernel build a table is for.

Every timed FP2 variant is also checked, after its counts are timed: its output for the first and the last sequence against the
plain-torch reference (`reference_decode`, the GPU tests' definition and tolerance, 3e-3 relative),
in the JSON as `check_rel_err` (the worst over the variants). A case over the tolerance is printed
and the script exits 1 after the table: a wrong kernel's time is not a result (and an A/B of source
variants through benchmarks/ab.sh then checks each variant too).

`--l2-pages N` points every sequence's block table at the first N pages, over and over (N = 256:
9 MB), and leaves out the L2 flush: the decode then reads its pages from L2, so its time is the
kernel's own work rather than DRAM's, at any B and L. A diagnostic for A/Bs of the main loop on a GPU
whose DRAM bounds it (the H100: docs/fp2-kernel.md, "Head per lane"), never a result: no serving
step finds its KV in L2. The writes and FP16 are not timed then.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from zerodram.runtime.argtypes import int_list
from zerodram.runtime.kv.format import DEFAULT_FP2

SHAPE = (32, 8, 128)  # Hq, Hkv, D (--shape)
P, HP = 64, 36  # page size (--page-size), bf16 sink/tail tokens
CHECK_TOL = 3e-3  # relative error against reference_decode, as tests/test_attention_gpu.py demands
DECODE_KERNEL, PROFILE_CALLS = "attn_fp2_decode", 5  # --profile: the kernel's name, calls profiled


def check_rel_err(att, q, layer, batch, L: int, num_splits: int | None, out=None) -> float:
    """The worst relative error of the module's output (or `out`, computed already) over the first
    and the last sequence against `reference_decode` (each sequence alone: the reference
    dequantizes its pages to fp32, ~1 GB at L = 128k)."""
    from zerodram.runtime.attention import DecodeBatch, reference_decode

    if out is None:
        out = att(q, layer, batch, max_len=L, num_splits=num_splits)
    worst = 0.0
    for b in sorted({0, q.shape[0] - 1}):
        one = DecodeBatch(
            block_table=batch.block_table[b : b + 1], fp2_len=batch.fp2_len[b : b + 1], hp_k=batch.hp_k,
            hp_v=batch.hp_v, hp_len=batch.hp_len[b : b + 1], hp_slot=batch.hp_slot[b : b + 1],
        )  # fmt: skip
        ref = reference_decode(q[b : b + 1], layer, one, att.softmax_scale, att.scale_dtype, att.value_product)[0]
        worst = max(worst, float((out[b] - ref).norm() / ref.norm().clamp_min(1e-30)))
    return worst


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int_list, default="1,8,32")
    p.add_argument("--lengths", type=int_list, default="8192,32768,131072")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument(
        "--configs",
        default="4x4",
        help="decode kernel variants WARPSxSTAGES[xMINBLOCKS[xKEY_S8]], comma separated (the best is reported)",
    )
    p.add_argument(
        "--v-layouts",
        default="quad",
        help="value page layouts to time each variant on (token, quad: what the cache stores), comma separated",
    )
    p.add_argument(
        "--splits",
        default="0",
        help="split counts to time each variant at, comma separated (0: the plan's, from the GPU's "
        "split table where one covers the case; wave: the wave model's; the workspace holds "
        "ceil(L / 1024) splits or the plan's most, a forced count beyond it is skipped)",
    )
    p.add_argument(
        "--shape", default="x".join(map(str, SHAPE)), metavar="HQxHKVxD",
        help="query heads, kv heads and head dim (a split table is per shape: the served model's may differ)",
    )  # fmt: skip
    p.add_argument(
        "--page-size", type=int, default=P,
        help="tokens per page (a split table is per page size: the engine's default is 32)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON line per case")
    p.add_argument("--no-fp16", action="store_true", help="skip the FP16 SDPA baseline")
    p.add_argument("--no-defer", action="store_true", help="skip the decode with the engine's append deferred after it")
    p.add_argument(
        "--write-kv", default=DEFAULT_FP2, metavar="SPEC",
        help="the format of the engine's append (`ewrite1_*`, `defer*`; default DEFAULT_FP2): one the "
        "decode-write kernel takes, with error feedback",
    )  # fmt: skip
    p.add_argument(
        "--profile", action="store_true",
        help="also the best count's decode kernel time by the torch profiler (fp2_profile_us: eager calls "
        "one at a time, L2 flushed before each but under --l2-pages), to set beside `engine_step.py --profile`",
    )  # fmt: skip
    p.add_argument(
        "--l2-pages", type=int, default=0,
        help="a diagnostic: every block table cycles over the first N pages and L2 is not flushed (0: off)",
    )  # fmt: skip


def _case(
    B: int,
    L: int,
    configs: list[tuple[int, int, int, int | None]],
    forced_splits: list[int | str | None],
    args: argparse.Namespace,
    flush,
    copy_bw: float,
) -> dict:
    """Time FP2 decode (each kernel variant at each split count; None: the plan's), the write
    kernel and FP16 SDPA for one (B, L)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from zerodram.runtime.attention import (
        Fp2DecodeAttention,
        Fp2Writer,
        random_decode_batch,
        random_fp2_layer,
    )
    from zerodram.runtime.metrics.devtime import device_activity, median_ms, medians_ms

    dev, HQ, HKV, D, P = "cuda", *args.shape, args.page_size
    gen = torch.Generator(device=dev).manual_seed(B * 7 + L)
    pages = B * math.ceil(L / P)
    layer = random_fp2_layer(pages, HKV, P, D, device=dev, generator=gen)
    batch = random_decode_batch([L] * B, [HP] * B, pages, HKV, P, D, hp_max=HP, device=dev, generator=gen)
    if args.l2_pages:  # the pages stay in L2 (the check's reference reads the same table)
        batch = replace(batch, block_table=batch.block_table % min(args.l2_pages, pages))
    q = torch.randn(B, HQ, D, device=dev, generator=gen)
    fp2_bytes = B * HKV * L * 2 * (D // 4 + D // 64) + B * HKV * HP * D * 2 * 2 + q.numel() * 4
    fp16_bytes = B * HKV * (L + HP) * D * 2 * 2
    row = {"B": B, "L": L, "Hq": HQ, "Hkv": HKV, "D": D, "P": P, "fp2_bytes": fp2_bytes, "fp16_bytes": fp16_bytes}
    variants = [(c, vl) for c in configs for vl in args.v_layouts.split(",")]
    for (warps, stages, min_blocks, key_s8), v_layout in variants:
        att = Fp2DecodeAttention(
            num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P, max_batch=B, max_fp2_tokens=L,
            device=dev, num_warps=warps, stages=stages, min_blocks=min_blocks, key_s8=None if key_s8 is None else bool(key_s8),
            v_layout=v_layout, workspace_splits=Fp2DecodeAttention.most_count(L),
        )  # fmt: skip
        name = f"{warps}x{stages}x{min_blocks}" + ("-int8keys" if att.key_s8 else "-fp16keys")  # what ran
        name += "-quad" if v_layout == "quad" else ""
        # random words are as random in either layout: the same pools, labelled
        vl_layer = replace(layer, v_layout=v_layout)
        row["split_key"] = att.kernels.cfg.split_key()
        row["plan_splits"], row["wave_splits"] = att.plan(B, L)[0], att.wave_plan(B, L)[0]
        row["plan_source"] = "table" if att.split_table and att.split_table.lookup(B, L) else "wave"
        timed = []  # (forced, splits, tag) of each count the workspace holds
        for forced in forced_splits:
            if forced == "wave":  # the count the wave model asks split for, so the split is the plan's own
                forced, splits, tag = att.wave_count(B, L), row["wave_splits"], f"{name}-wave"
            elif forced is None:
                splits, tag = row["plan_splits"], name
            else:
                splits = att.split(L, forced)[0]
                tag = f"{name}-s{splits}"
            if splits > att.max_splits:
                print(f"# B={B} L={L}: {forced} splits exceed the workspace's {att.max_splits}, skipped", file=sys.stderr)
                continue
            if any(tag == t for _, _, t in timed):
                continue  # two counts that split L the same way
            timed.append((forced, splits, tag))
        # The counts' repetitions interleaved and every check after them: a count timed right after
        # another's check (its reference dequantizes ~1 GB a sequence at 128k) ran up to 17% slower
        # (docs/benchmarks.md, "What the first count timed had").
        times = medians_ms(
            [
                lambda att=att, vl_layer=vl_layer, forced=forced: att(q, vl_layer, batch, max_len=L, num_splits=forced)
                for forced, _, _ in timed
            ],
            args.reps,
            flush,
        )
        for (forced, splits, tag), ms in zip(timed, times, strict=True):
            row[f"fp2_ms_{tag}"] = ms
            err = check_rel_err(att, q, vl_layer, batch, L, forced)
            row["check_rel_err"] = max(row.get("check_rel_err", 0.0), err)
            if err > CHECK_TOL:
                print(f"# CHECK FAILED: B={B} L={L} {tag}: relative error {err:.2e} > {CHECK_TOL}", file=sys.stderr)
            if "fp2_ms" not in row or ms < row["fp2_ms"]:
                row["fp2_ms"], row["fp2_config"], row["splits"] = ms, tag, splits
                best, best_layer, best_forced = att, vl_layer, forced
    if "fp2_ms" not in row:
        raise SystemExit(f"B={B} L={L}: every --splits count exceeds the workspace; nothing was timed")
    if args.profile:
        # The kernel's own device time, as engine_step.py --profile reads it inside a served step:
        # the replay's launch and drain, which the event times above include, left out.
        acts = device_activity(
            lambda: (flush.sum(), best(q, best_layer, batch, max_len=L, num_splits=best_forced)), PROFILE_CALLS
        )
        found = [us for name, us, _ in acts if name == DECODE_KERNEL]
        if not found:  # a renamed kernel: fail, rather than report 0
            raise SystemExit(f"--profile: no {DECODE_KERNEL!r} among the profiled kernels {[n for n, _, _ in acts]}")
        row["fp2_profile_us"] = sum(found)
    row["fp2_gbps"] = fp2_bytes / (row["fp2_ms"] * 1e-3) / 1e9
    row["fp2_frac_copy_bw"] = row["fp2_gbps"] * 1e9 / copy_bw
    if args.l2_pages:
        return row
    writer = Fp2Writer(head_dim=D, device=dev, v_layout=best_layer.v_layout)
    for n_tok, tag in ((1, "write1"), (32, "flush32")):
        y = torch.randn(B * n_tok, HKV, 2, D, device=dev, generator=gen)
        s = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(n_tok)
        # write1: each sequence's newest FP2 token (what a decode step's append writes); flush32: the first 32
        if n_tok == 1:
            f = (batch.fp2_len - 1).clamp_min(0)
        else:
            f = torch.arange(n_tok, device=dev, dtype=torch.int32).repeat(B)
        row[f"{tag}_ms"] = median_ms(
            lambda y=y, s=s, f=f: writer.write(y, s, f, best_layer, batch.block_table), 10, flush
        )
        if n_tok == 1:
            # What the append adds to a decode step: one graph with both, minus attention alone (a
            # lone small kernel's time here is mostly a graph replay's fixed cost: the one-token
            # write measures ~7 us alone on the H200 and adds ~5 beside the decode).
            both = median_ms(
                lambda y=y, s=s, f=f: (
                    writer.write(y, s, f, best_layer, batch.block_table),
                    best(q, best_layer, batch, max_len=L, num_splits=best_forced),
                ),
                args.reps,
                flush,
            )
            row["write1_added_ms"] = max(0.0, both - row["fp2_ms"])
            # The engine's own append (DEFAULT_FP2: a bf16 window, the new token rounded with error
            # feedback at arrival): kernels/kv_write.py's kernel on the same pools, every row flushing
            write, wargs = _engine_write(B, best_layer, batch, gen, args.write_kv)
            row["write_kv"] = args.write_kv
            row["ewrite1_ms"] = median_ms(lambda write=write, wargs=wargs: write(*wargs), 10, flush)
            both = median_ms(
                lambda write=write, wargs=wargs: (
                    write(*wargs), best(q, best_layer, batch, max_len=L, num_splits=best_forced)
                ),
                args.reps,
                flush,
            )
            row["ewrite1_added_ms"] = max(0.0, both - row["fp2_ms"])
            if not args.no_defer:
                _deferred_write(row, B, L, q, best, best_layer, batch, best_forced, write, wargs, args, flush)
    if not args.no_fp16:
        k = torch.randn(B, HKV, L + HP, D, device=dev, dtype=torch.float16, generator=gen)
        v = torch.randn_like(k)
        q16 = q.to(torch.float16)[:, :, None]  # [B, Hq, 1, D]
        row["fp16_ms"] = median_ms(lambda: sdpa(q16, k, v, enable_gqa=True), args.reps, flush)
        row["fp16_gbps"] = fp16_bytes / (row["fp16_ms"] * 1e-3) / 1e9
        row["speedup"] = row["fp16_ms"] / row["fp2_ms"]
        del k, v
    torch.cuda.empty_cache()
    return row


def _engine_write(B: int, layer, batch, gen, kv: str):
    """A call of the engine's decode write (kernels/kv_write.py, what `Fp2KVCache.write_decode_static`
    launches) for B sequences in the shape of format `kv` (`--write-kv`, default DEFAULT_FP2: its
    sinks, window, scale dtype and rules, feedback blocks; error feedback on both sides with a
    random factor, zero between the format's feedback blocks: the values do not change the work), every row
    flushing (its tail moves up) and its new token's codes going to the last FP2 slot of its
    sequence's pages (the layer's pools; in the engine they go W slots past the attended range)."""
    import torch

    from zerodram.kernels.kv_write import Fp2DecodeWrite
    from zerodram.runtime.kv.feedback import block_mask
    from zerodram.runtime.kv.format import parse_kv_spec
    from zerodram.runtime.kv.fp2_decode_write import decode_write_config
    from zerodram.runtime.kv.quantize import MSE_FRACTIONS

    spec = parse_kv_spec(kv).spec  # checked by run()
    dev, sinks, window = layer.k_codes.device, spec.num_sinks, spec.window
    HKV, P, D = layer.k_codes.shape[1], layer.k_codes.shape[2], layer.k_codes.shape[3] * 16  # k_codes [NP, Hkv, P, D / 16]
    cfg, _ = decode_write_config(spec, D, v_quad=layer.v_layout == "quad")  # the cache's build (checked by run())
    write = Fp2DecodeWrite(cfg, (spec.k.scale_rule, spec.v.scale_rule), MSE_FRACTIONS, dev)
    hp = [torch.randn(B + 1, HKV, sinks + window + 1, D, device=dev, generator=gen).bfloat16() for _ in range(2)]  # [B + 1, H, R, D]
    y = [torch.randn(B, HKV, D, device=dev, generator=gen).bfloat16() for _ in range(2)]
    eye = torch.eye(D, device=dev)
    rows = [eye + 0.1 * torch.randn(HKV, D, D, device=dev, generator=gen).triu(1) for _ in range(2)]  # [H, D, D]
    for i, side in enumerate((spec.k, spec.v)):  # each side's factor: zero between its feedback blocks
        rows[i] = rows[i] * block_mask(D, side.feedback_block, dev)
    f = (batch.fp2_len[:B].long() - 1).clamp_min(0)
    page = batch.block_table[:B].long().gather(1, (f // P)[:, None])[:, 0]
    ones = torch.ones(B, dtype=torch.long, device=dev)
    # StaticDecodeIndex's rows: slot b, the arriving row S + W, flush, the codes' page and page row
    index = torch.stack([torch.arange(B, device=dev), ones * (sinks + window), ones, page, f % P]).contiguous()
    return write, (
        y[0], y[1], index, hp[0], hp[1], layer.k_codes, layer.v_codes, layer.k_scales, layer.v_scales,
        layer.levels[:4], layer.levels[4:], rows[0], rows[1], sinks, window,
    )  # fmt: skip


def _deferred_write(row, B, L, q, best, layer, batch, forced, write, wargs, args, flush) -> None:
    """The engine's append deferred as its whole-step graphs make it (`defer_write`,
    docs/fp2-kernel.md "Codes at arrival"): the best config reads the new tokens from the step's
    tensors and the tails of `_engine_write`'s regions as they are, then the write runs on a
    low-priority stream (its codes into each sequence's last FP2 slot, which the decode's range
    stops before; in the engine they go W slots past the range); captured on a high-priority
    stream, as the engine captures its step. A layer's write overlaps what follows it in the step,
    so the timed sequence is four such layers with one join at the end, against four plain decodes
    (`defer1_added_ms`, per layer; the feed-forward work between layers, which the writes may also
    overlap, is left out), and one layer joined right after its decode (`defer1_alone_added_ms`:
    nothing after it to overlap). The last write of a step has nothing after it in these graphs to
    hide behind, and four layers count a quarter of its latency in each: sixteen layers
    (`defer16_added_ms`, fewer than any model in runtime/model/named.py but the test ones) count a
    sixteenth, and the difference of the two graphs' added times over the twelve layers between
    them (`defer_steady_added_ms`) is a layer's cost with that tail left out, the tail being
    hidden in a served step as far as the work after the last layer covers it. Each count of
    layers is timed plain and deferred with their repetitions interleaved (`medians_ms`): timed
    one after the other, whichever of the two 16-layer graphs came second ran 55-93 us a layer
    slower at B = 32, L = 128k on an H100. Each layer has its own bf16 regions (copies of the
    write's: sinks + window rows, instead of the decode's 36 tokens), as the engine's layers do,
    so no decode reads a tail that another layer's write moves; they share the pools (the writes'
    codes go past every decode's range; where the pages fit in L2, the layers after the first read
    them there, plain and deferred alike). Checked like the other variants: one more call, then
    the reference over the written cache."""
    import torch

    from zerodram.runtime.attention import DecodeBatch
    from zerodram.runtime.metrics.devtime import medians_ms

    sinks, window = wargs[-2], wargs[-1]
    dev = q.device
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    hp_len = torch.full((B,), sinks + window, dtype=torch.int32, device=dev)
    fp2_len = (batch.fp2_len - 1).clamp_min(0)
    per_layer = [wargs] + [(*wargs[:3], wargs[3].clone(), wargs[4].clone(), *wargs[5:]) for _ in range(15)]
    shorts = [DecodeBatch(batch.block_table, fp2_len, w[3], w[4], hp_len, slots) for w in per_layer]
    pendings = [write.pending(*w) for w in per_layer]
    short, pending = shorts[0], pendings[0]
    least, greatest = torch.cuda.Stream.priority_range()
    side, capture = torch.cuda.Stream(priority=least), torch.cuda.Stream(priority=greatest)

    def layers(n: int, defer: bool):
        def run():
            for i in range(n):
                if defer:
                    best(q, layer, shorts[i], max_len=L, num_splits=forced, pending=pendings[i])
                    pendings[i].write_after(side)
                else:
                    best(q, layer, batch, max_len=L, num_splits=forced)
            if defer:
                torch.cuda.current_stream().wait_stream(side)  # the engine's step end (StaticAttention.join)

        return run

    def pair(n: int) -> list[float]:
        """ms of n plain layers and of n deferred ones, their repetitions interleaved"""
        return medians_ms([layers(n, False), layers(n, True)], args.reps, flush, capture_stream=capture)

    four_plain, four_deferred = pair(4)
    row["defer1_ms"] = four_deferred / 4
    row["defer1_added_ms"] = (four_deferred - four_plain) / 4
    one_plain, one_deferred = pair(1)
    row["defer1_alone_added_ms"] = one_deferred - one_plain
    plain16, deferred16 = pair(16)
    row["plain16_ms"], row["defer16_ms"] = plain16 / 16, deferred16 / 16  # per layer, beside fp2_ms
    row["defer16_added_ms"] = (deferred16 - plain16) / 16
    row["defer_steady_added_ms"] = (deferred16 - plain16 - (four_deferred - four_plain)) / 12
    # one more step, checked: its output against the reference over the cache the write leaves
    out = best(q, layer, short, max_len=L, num_splits=forced, pending=pending).clone()
    write(*wargs)
    err = check_rel_err(best, q, layer, short, L, forced, out=out)
    row["check_rel_err"] = max(row.get("check_rel_err", 0.0), err)
    if err > CHECK_TOL:
        print(f"# CHECK FAILED: B={B} L={L} deferred write: relative error {err:.2e} > {CHECK_TOL}", file=sys.stderr)


def _write_kv_problem(kv: str, D: int) -> str | None:
    """Why `--write-kv` cannot be the engine's append timed here (None: it can)."""
    from zerodram.runtime.errors import ConfigError
    from zerodram.runtime.kv.format import Fp2Spec, parse_kv_spec

    try:
        spec = parse_kv_spec(kv).spec
    except ConfigError as err:
        return str(err)
    if not isinstance(spec, Fp2Spec) or not (spec.k.feedback and spec.v.feedback and spec.window):
        return "the engine's append here is an FP2 format with a window and feedback on both sides"
    sides = (spec.k, spec.v)
    if any(x.block_axis != "channel" or x.block_size != 64 or x.scale_dtype != "e4m3" for x in sides):
        # the write goes into the timed decode's pools (random_fp2_layer's defaults)
        return "the pools timed here have E4M3 scales over blocks of 64 channels (c64): the append's must match"
    from zerodram.runtime.kv.fp2_decode_write import decode_write_config

    return decode_write_config(spec, D, v_quad=False)[1]  # the kernel's limits (the layout changes none)


def run(args: argparse.Namespace) -> int:
    import torch

    from zerodram.runtime.metrics.devtime import copy_bandwidth

    if args.l2_pages < 0:
        print(f"--l2-pages takes a page count >= 0 (0: off), got {args.l2_pages}", file=sys.stderr)
        return 2
    try:
        forced_splits = [x if x == "wave" else int(x) or None for x in args.splits.split(",")]
    except ValueError:
        forced_splits = [-1]
    if any(isinstance(x, int) and x < 0 for x in forced_splits):
        print(f"--splits takes counts >= 0 (0: the plan's) or 'wave', got {args.splits}", file=sys.stderr)
        return 2
    shape = [int(x) if x.isdigit() else 0 for x in args.shape.split("x")]
    if len(shape) != 3 or min(shape) < 1:
        print(f"--shape takes HQxHKVxD, three positive integers, got {args.shape!r}", file=sys.stderr)
        return 2
    args.shape = tuple(shape)  # (Hq, Hkv, D), what _case reads
    if args.page_size < 32 or args.page_size % 32:
        print(f"--page-size takes a positive multiple of 32, got {args.page_size}", file=sys.stderr)
        return 2
    why = _write_kv_problem(args.write_kv, args.shape[2])
    if why:
        print(f"--write-kv {args.write_kv!r}: {why}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("attention benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    # 256 MB, read before each rep (--l2-pages: one float, so L2 keeps the pages)
    flush = torch.zeros(1 if args.l2_pages else 64 << 20, dtype=torch.float32, device="cuda")
    copy_bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"# {name}, measured copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    if args.l2_pages:
        print(f"# --l2-pages {args.l2_pages}: pages read from L2; a diagnostic, not a result (GB/s and %copy "
              "count the bytes as if from DRAM)", flush=True)
    defaults = (4, 4, 1, None)  # warps, stages, min blocks, key_s8 (None: the runtime's choice)
    configs = []
    for c in args.configs.split(","):
        given = [int(x) for x in c.split("x")]
        configs.append((*given, *defaults[len(given) :]))
    # Bring the clocks up before the first case is timed (an idle GPU starts slow).
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    rows = []
    for B in args.batches:
        for L in args.lengths:
            row = _case(B, L, configs, forced_splits, args, flush, copy_bw)
            rows.append(row)
            if args.json:
                print(
                    json.dumps({"bench": "attention", "device": name, "copy_bw": copy_bw, "l2_pages": args.l2_pages, **row}),
                    flush=True,
                )
    nan = float("nan")
    print(
        f"\n{'B':>3} {'L':>7} {'cfg':>7} {'splits':>6} {'FP2 ms':>8} {'GB/s':>6} {'%copy':>6} {'FP16 ms':>8} "
        f"{'GB/s':>6} {'speedup':>7} {'write1 us':>9} {'+write1 us':>10} {'flush32 us':>10} {'+ewrite1 us':>11}"
        f" {'+defer1 us':>10} {'+defer16':>8} {'steady':>6} {'alone':>6}"
    )
    for r in rows:
        print(
            f"{r['B']:>3} {r['L']:>7} {r['fp2_config']:>7} {r['splits']:>6} {r['fp2_ms']:>8.4f} "
            f"{r['fp2_gbps']:>6.0f} {100 * r['fp2_frac_copy_bw']:>5.1f}% {r.get('fp16_ms', nan):>8.4f} "
            f"{r.get('fp16_gbps', nan):>6.0f} {r.get('speedup', nan):>6.2f}x "
            f"{1e3 * r.get('write1_ms', nan):>9.1f} {1e3 * r.get('write1_added_ms', nan):>10.1f} {1e3 * r.get('flush32_ms', nan):>10.1f}"
            f" {1e3 * r.get('ewrite1_added_ms', nan):>11.1f} {1e3 * r.get('defer1_added_ms', nan):>10.1f}"
            f" {1e3 * r.get('defer16_added_ms', nan):>8.1f} {1e3 * r.get('defer_steady_added_ms', nan):>6.1f}"
            f" {1e3 * r.get('defer1_alone_added_ms', nan):>6.1f}"
        )
    worst = max(r["check_rel_err"] for r in rows)
    print(f"output check: worst relative error {worst:.2e} against reference_decode (tolerance {CHECK_TOL})")
    if worst > CHECK_TOL:
        print(f"attention benchmark: an FP2 variant's output is off by {worst:.2e} (> {CHECK_TOL}); its times are "
              "not results (the cases are named above)", file=sys.stderr)
        return 1
    return 0



if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
