"""The paged caches' decode-time writes (runtime/kv/fp2_decode_write.py for FP2): a batched
append_decode equals one append per sequence, the fixed-shape plan + write (what a CUDA graph
captures; on CUDA the decode-write kernel) equals append_decode, a mirrored plan equals planning
every layer, and bad decode appends are refused or flagged without writing."""

from __future__ import annotations

import pytest
import torch
from kv_cases import FORMATS, D, H, kv_tokens, make_cache

from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.kv.errors import KVInputError
from zerodram.runtime.kv.feedback import block_mask


def _state(c) -> list[torch.Tensor]:
    """Every tensor a cache writes (pages, scales, offsets, the bf16 region's live rows; its rows
    past a sequence's tail, the scratch page and the scratch slot are unspecified)."""
    if c.format != "fp2":
        return [c.k_pages, c.v_pages]
    NP, slots = c.num_pages, c.tables.max_seqs
    hp_k, hp_v = c.hp_k[:slots].clone(), c.hp_v[:slots].clone()
    S = c.spec.num_sinks
    for slot, n in c.tables.lens.items():
        live = min(n, S) if n <= S else n - c.rule.num_quantized(n)  # sinks + tail rows
        hp_k[slot, :, live:] = 0
        hp_v[slot, :, live:] = 0
    out = [hp_k, hp_v]
    for side in (c.k, c.v):
        out += [side.codes[:NP], side.scales[:NP]] + ([side.offsets[:NP]] if side.offsets is not None else [])
    return out


@pytest.mark.parametrize(
    ("fmt", "device"),
    [(f, "cpu") for f in FORMATS]
    + [
        pytest.param(f, "cuda", marks=pytest.mark.gpu) for f in ("fp2", "fp2:tail=1,window=32")
    ],  # the CUDA kernels
)
def test_decode_append_equals_per_sequence_appends(fmt: str, device: str) -> None:
    """append_decode over a batch writes exactly what one append per sequence writes: sequences at
    different lengths (sinks, a filling tail, flushes, page boundaries), joining and leaving."""
    a, b = (make_cache(fmt, num_pages=24, max_seqs=6, device=device) for _ in range(2))
    b2 = make_cache(fmt, num_pages=24, max_seqs=6, device=device)  # a second "layer" of b's partition
    if hasattr(b, "index_memo"):
        b2.index_memo = b.index_memo  # as RuntimeKVPartition shares it: b2 reuses b's indices
    gen = torch.Generator().manual_seed(5)
    starts = [0, 3, 31, 46, 63, 90]  # prefilled lengths before the decode steps
    seqs = []
    for n0 in starts:
        sa, sb = a.new_sequence(), b.new_sequence()
        assert sa == sb == b2.new_sequence()
        if n0:
            k, v = (t.to(device) for t in kv_tokens(n0, seed=n0))
            a.append(sa, k, v)
            b.append(sb, k, v)
            b2.append(sb, k, v)
        seqs.append(sa)
    for step in range(70):
        live = [s for i, s in enumerate(seqs) if step < 40 or i % 2]  # half of them leave at step 40
        k = torch.randn(len(live), H, D, generator=gen).to(device)
        v = torch.randn(len(live), H, D, generator=gen).to(device)
        for i, s in enumerate(live):
            a.append(s, k[i : i + 1], v[i : i + 1])
        b.append_decode(live, k, v)
        b2.append_decode(live, k, v)
        assert [a.seq_len(s) for s in live] == [b.seq_len(s) for s in live]
        assert a.tables.pages == b.tables.pages == b2.tables.pages
    for ta, tb, tb2 in zip(_state(a), _state(b), _state(b2), strict=True):
        assert torch.equal(ta, tb) and torch.equal(ta, tb2)


@pytest.mark.parametrize(
    ("fmt", "device", "d", "l2"),
    [
        ("fp2:tail=1,window=32", "cpu", D, False),
        ("fp2:sinks=0,tail=1,window=0,scale=e8m0", "cpu", D, False),
        pytest.param("fp2:tail=1,window=32", "cuda", D, False, marks=pytest.mark.gpu),
        pytest.param("fp2:fb=1,tail=1,window=47", "cuda", D, False, marks=pytest.mark.gpu),  # DEFAULT_FP2
        # the same through the build that reads the factor from L2 (long grids)
        pytest.param("fp2:fb=1,tail=1,window=47", "cuda", D, True, marks=pytest.mark.gpu),
        # the engine's head dim: the kernel's staged factor is 64 KB there (dynamic shared memory
        # past the 48 KB default, kernels/kv_write.py). Without the rotation: at D = 128 cuBLAS
        # rounds x @ R differently for the torch body's len(live) rows than for the Bp rows the
        # kernel's caller moves (seen on the H100), so the two would quantize different inputs.
        pytest.param("fp2:fb=1,tail=1,window=47,rot=0", "cuda", 128, False, marks=pytest.mark.gpu),
        pytest.param("fp2:fb=1,tail=1,window=47,rot=0", "cuda", 128, True, marks=pytest.mark.gpu),
        # feedback on the keys only: the launch stages the factor for the K side's CTAs, the V
        # side's have none
        pytest.param("fp2:kfb=1,tail=1,window=47", "cuda", D, False, marks=pytest.mark.gpu),
        pytest.param(
            "fp2:fb=1,tail=1,window=7,blk=c32,scale=e8m0,krule=absmax", "cuda", D, False, marks=pytest.mark.gpu
        ),
        # D = 96: a lane's 3 channels of the chain straddle two 32-channel blocks (lanes 10 and 21)
        pytest.param("fp2:fb=1,tail=1,window=47,blk=c32,rot=0", "cuda", 96, False, marks=pytest.mark.gpu),
        # feedback blocks of 32 channels: the kernel runs the blocks' chains side by side (FB_BLOCK)
        ("fp2:fb=1,fbblk=32,tail=1,window=47", "cpu", D, False),
        pytest.param("fp2:fb=1,fbblk=32,tail=1,window=47", "cuda", D, False, marks=pytest.mark.gpu),
        pytest.param("fp2:fb=1,fbblk=32,tail=1,window=47,rot=0", "cuda", 128, False, marks=pytest.mark.gpu),
        pytest.param("fp2:fb=1,fbblk=32,tail=1,window=47,rot=0", "cuda", 128, True, marks=pytest.mark.gpu),
        pytest.param("fp2:fb=1,fbblk=32,tail=1,window=7,blk=c32,scale=e8m0", "cuda", D, True, marks=pytest.mark.gpu),
    ],
)
def test_static_decode_write_equals_append_decode(fmt: str, device: str, d: int, l2: bool) -> None:
    """The fixed-shape decode write (host plan + device write over a padded batch, what a CUDA
    graph captures) leaves exactly the cache `append_decode` leaves: sinks, a filling window,
    flushes, page boundaries, sequences leaving; padding rows of garbage go to the scratch slot.
    On CUDA the write is the decode-write kernel (kernels/kv_write.py) and `append_decode` the
    torch reference; error feedback gets a random factor (calibration's shape, not its values).
    Some rows are scaled to ~1e-38, so that the kernel's feedback chain also takes its exact pass
    (the divisions, for values within the band of a midpoint: here under FLT_MIN, beside 0)."""
    import dataclasses

    from zerodram.runtime.kv.decode_index import StaticDecodeIndex

    a = make_cache(fmt, num_pages=24, head_dim=d, max_seqs=6, device=device, static_kernel=False)  # the torch body
    b = make_cache(fmt, num_pages=24, head_dim=d, max_seqs=6, device=device)
    assert a._static_write is None and (b._static_write is not None) == (device == "cuda")
    if l2:
        b._static_write.max_staged_ctas = 0  # every grid takes the L2 build
    if "fb=1" in fmt:
        g = torch.Generator().manual_seed(3)
        factor = (torch.eye(d) + 0.2 * torch.randn(H, d, d, generator=g).tril(-1)).transpose(1, 2)  # upper
        factor = factor * block_mask(d, a.spec.k.feedback_block)  # the format's: zero between its blocks
        for c in (a, b):
            c.params = tuple(dataclasses.replace(p, feedback=factor) for p in c.params)
    gen = torch.Generator().manual_seed(7)
    seqs = []
    for n0 in (0, 3, 31, 46, 63, 90):
        sa, sb = a.new_sequence(), b.new_sequence()
        assert sa == sb
        if n0:
            k, v = (t.to(device) for t in kv_tokens(n0, seed=n0, head_dim=d))
            a.append(sa, k, v)
            b.append(sb, k, v)
        seqs.append(sa)
    Bp = 8
    ix = StaticDecodeIndex.allocate(Bp, torch.device(device))
    k_in, v_in = (torch.zeros(Bp, H, d, device=device) for _ in range(2))  # a graph's static inputs
    graph = None
    if device == "cuda":  # the write captured once, replayed every step (what the engine does)
        ix.fill_scratch(b.scratch_slot, b.scratch_page)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b.write_decode_static(k_in, v_in, ix)  # warm-up, on scratch rows only
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b.write_decode_static(k_in, v_in, ix)
    for step in range(70):
        live = [s for i, s in enumerate(seqs) if step < 40 or i % 2]
        k = torch.randn(Bp, H, d, generator=gen).to(device) * 3  # rows past len(live): padding
        v = torch.randn(Bp, H, d, generator=gen).to(device) * 3
        if step % 9 == 4:  # values under FLT_MIN beside the zero midpoint: the kernel's exact pass
            k[0] *= 1e-38
            v[0] *= 1e-38
        a.append_decode(live, k[: len(live)], v[: len(live)])
        ix.fill(b.plan_decode_static(live), b.scratch_slot, b.scratch_page)
        k_in.copy_(k)
        v_in.copy_(v)
        if graph is None:
            b.write_decode_static(k_in, v_in, ix)
        else:
            graph.replay()
        assert [a.seq_len(s) for s in live] == [b.seq_len(s) for s in live]
    assert a.tables.pages == b.tables.pages
    for ta, tb in zip(_state(a), _state(b), strict=True):
        assert torch.equal(ta, tb)
    assert not make_cache("fp2:tail=4,window=8").static_decode_ok
    with pytest.raises(ConfigError, match="flush 1"):
        make_cache("fp2:tail=4,window=8").plan_decode_static([])


def _decode_batch(cache, live: list[int], Bp: int):
    """The decode metadata of a padded step (Bp rows, the first len(live) real) after its write: FP2
    and bf16 counts per row, block-table rows; padding rows attend to one scratch-slot token."""
    from zerodram.runtime.attention import DecodeBatch

    rule, dev = cache.rule, cache.device
    lens = [cache.seq_len(s) for s in live]
    fp2 = [rule.num_quantized(n) for n in lens] + [0] * (Bp - len(live))
    hp = [n - rule.num_quantized(n) for n in lens] + [1] * (Bp - len(live))
    table = torch.zeros(Bp, cache.tables.max_pages_per_seq, dtype=torch.int32)
    for b, s in enumerate(live):
        table[b, : len(cache.tables.pages[s])] = torch.tensor(cache.tables.pages[s], dtype=torch.int32)
    i32 = {"dtype": torch.int32, "device": dev}
    slots = [*live, *[cache.scratch_slot] * (Bp - len(live))]
    return DecodeBatch(
        table.to(dev), torch.tensor(fp2, **i32), cache.hp_k, cache.hp_v, torch.tensor(hp, **i32),
        torch.tensor(slots, **i32),
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("fmt", "d", "group"),
    [
        ("fp2:fb=1,tail=1,window=47", 128, 4),  # DEFAULT_FP2 at the engine's head dim (quad values)
        ("fp2:fb=1,tail=1,window=47", 64, 8),
        ("fp2:kfb=1,tail=1,window=7,blk=c32,scale=e8m0,krule=absmax", 64, 1),
        # key and value blocks that differ, a window of 1 (a new token's codes are read in the next
        # step), a window whose shift takes two rounds, E8M0 at D = 128
        ("fp2:fb=1,tail=1,window=1,sinks=0", 64, 3),
        ("fp2:fb=1,tail=1,window=5,kblk=c32,vblk=c64", 128, 5),
        ("fp2:vfb=1,tail=1,window=100,kblk=c64,vblk=c32,scale=e8m0", 128, 8),
        ("fp2:fb=1,fbblk=32,tail=1,window=47", 128, 4),  # the blocks' chains side by side
    ],
)
def test_pending_append_equals_write_then_decode(fmt: str, d: int, group: int) -> None:
    """The decode write made after the decode that attends its tokens (the rows' bf16 CTAs read the
    new tokens from the step's tensors and the tails as they were, less the row a flush drops; the
    write on a side stream after it, as the engine's step runs it) leaves the cache the write
    before the decode leaves (bytes) and returns, bit for bit, what the write followed by the
    decode returns (and within 3e-3 of the FP2 reference after the last step): rows in their
    sinks, filling the window and flushing, page boundaries, rows leaving, padding rows, 60 steps
    with fresh random tokens. A format without a window cannot defer its write (its decode reads
    the new token's codes)."""
    import dataclasses

    from attention_cases import rel_error

    from zerodram.runtime.attention import Fp2DecodeAttention, layer_from_cache, reference_decode
    from zerodram.runtime.kv.decode_index import StaticDecodeIndex

    a, b = (make_cache(fmt, num_pages=24, head_dim=d, max_seqs=6, device="cuda") for _ in range(2))
    spec = a.spec
    g = torch.Generator().manual_seed(11)
    factor = (torch.eye(d) + 0.2 * torch.randn(H, d, d, generator=g).tril(-1)).transpose(1, 2)  # upper
    factor = factor * block_mask(d, spec.k.feedback_block)  # the format's factor: zero between its blocks
    for c in (a, b):  # a random factor where the format feeds errors back (calibration's shape)
        c.params = tuple(
            dataclasses.replace(p, feedback=factor) if side.feedback else p
            for side, p in zip((spec.k, spec.v), c.params, strict=True)
        )
    shape = {
        "num_q_heads": H * group, "num_kv_heads": H, "head_dim": d, "page_size": a.page_size,
        "k_block": spec.k.block_size, "v_block": spec.v.block_size, "scale_dtype": spec.k.scale_dtype,
        "max_batch": 8, "max_fp2_tokens": a.num_pages * a.page_size, "device": "cuda", "v_layout": a.v.layout,
    }  # fmt: skip
    att = Fp2DecodeAttention(**shape)
    gen = torch.Generator().manual_seed(13)
    seqs = []
    for n0 in (0, 3, 31, 46, 63, 130):
        sa, sb = a.new_sequence(), b.new_sequence()
        assert sa == sb
        if n0:
            k, v = (t.cuda() for t in kv_tokens(n0, seed=n0, head_dim=d))
            a.append(sa, k, v)
            b.append(sb, k, v)
        seqs.append(sa)
    Bp = 8
    ixa, ixb = (StaticDecodeIndex.allocate(Bp, torch.device("cuda")) for _ in range(2))
    side = torch.cuda.Stream()
    worst = 0.0
    for step in range(60):
        live = [s for i, s in enumerate(seqs) if step < 30 or i % 2]
        k = torch.randn(Bp, H, d, generator=gen).cuda() * 3  # rows past len(live): padding
        v = torch.randn(Bp, H, d, generator=gen).cuda() * 3
        q = torch.randn(Bp, H * group, d, generator=gen).cuda()
        ixa.fill(a.plan_decode_static(live), a.scratch_slot, a.scratch_page)
        ixb.fill(b.plan_decode_static(live), b.scratch_slot, b.scratch_page)
        a.write_decode_static(k, v, ixa)
        out_a = att(q, layer_from_cache(a), _decode_batch(a, live, Bp)).clone()
        pending = b.pending_append(k, v, ixb)
        out_b = att(q, layer_from_cache(b), _decode_batch(b, live, Bp), pending=pending)
        pending.write_after(side)  # as the engine's step runs it
        torch.cuda.current_stream().wait_stream(side)  # the step's end (StaticAttention.join)
        n = len(live)  # (padding rows read a scratch row that every padding write races for)
        worst = max(worst, rel_error(out_b[:n], out_a[:n]))
        assert torch.equal(out_b[:n], out_a[:n]), (step, worst)
    for ta, tb in zip(_state(a), _state(b), strict=True):
        assert torch.equal(ta, tb)
    ref = reference_decode(
        q[:n], layer_from_cache(b), _decode_batch(b, live, n), att.softmax_scale, spec.k.scale_dtype
    )
    assert rel_error(out_b[:n], ref) <= 3e-3
    c = make_cache("fp2:fb=1,tail=1,window=0,sinks=0", num_pages=2, head_dim=d, device="cuda")
    with pytest.raises(ConfigError, match="window"):
        c.pending_append(k, v, ixb)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_static_decode_write_refuses_mismatched_rows_and_dtypes(device: str) -> None:
    """The torch body (CPU) and the decode-write kernel (CUDA) share one check of their inputs:
    k, v [Bp, H, D] fp32 / bf16 / fp16 on the cache's device, one row per index row; a refused
    write changes nothing."""
    from zerodram.runtime.kv.decode_index import StaticDecodeIndex

    c = make_cache("fp2:tail=1,window=32", num_pages=8, max_seqs=4, device=device)
    a, b = c.new_sequence(), c.new_sequence()
    c.append(a, *(t.to(device) for t in kv_tokens(40, seed=3)))
    ix = StaticDecodeIndex.allocate(2, torch.device(device))
    ix.fill(c.plan_decode_static([a, b]), c.scratch_slot, c.scratch_page)
    before = [t.clone() for t in _state(c)]
    g = torch.Generator().manual_seed(12)
    k, v = (torch.randn(2, H, D, generator=g).to(device) for _ in range(2))
    writes = [c.write_decode_static] + ([c.pending_append] if device == "cuda" else [])
    for write in writes:
        with pytest.raises(KVInputError, match=r"K and V are \(1, 2, 64\), the index has 2 rows"):
            write(k[:1], v[:1], ix)  # would broadcast one token into both rows
        with pytest.raises(KVInputError, match=r"K must be fp32, bf16 or fp16, got torch\.float64"):
            write(k.double(), v.double(), ix)
        with pytest.raises(KVInputError, match=r"V must be \[T, 2, 64\] \(tokens, KV heads, head dim\), got \(2, 2, 32\)"):
            write(k, v[..., :32], ix)
    assert all(torch.equal(x, y) for x, y in zip(before, _state(c), strict=True))
    c.write_decode_static(k, v, ix)
    assert [c.gather(s)[0].shape[0] for s in (a, b)] == [41, 1]


def test_pending_append_names_other_regions() -> None:
    """A pending append names the bf16 regions a decode reads that its write does not write
    (`Fp2DecodeAttention` refuses such a call with those names: the decode would attend one
    cache's tail and the write go to another's)."""
    import numpy as np

    from zerodram.kernels.kv_write import PendingAppend
    from zerodram.kernels.module import ptr

    hk, hv = torch.zeros(4), torch.zeros(4)
    pending = PendingAppend(args=PendingAppend.NONE, rows=1, targets=(ptr(hk), ptr(hv)))
    assert pending.other_regions(hk, hv) == []
    assert pending.other_regions(hk, torch.zeros(4)) == ["hp_v"]
    assert len(PendingAppend.NONE) == 4 and PendingAppend.NONE[0] == np.uint64(0)


@pytest.mark.parametrize(
    ("d", "blocks", "fb"),
    [(64, (32, 64), 0), (96, (32, 32), 0), (128, (64, 64), 0), (256, (64, 64), 0), (64, (32, 64), 32), (128, (64, 64), 32)],
)
def test_decode_write_builds_compile(d: int, blocks: tuple[int, int], fb: int) -> None:
    """Both builds of the decode-write kernel (factor staged in shared memory, or read through L2)
    compile at head dims whose chains differ (NVRTC; no GPU needed): D = 96 runs 24-channel passes
    that 32-channel blocks straddle, D = 256 has only the L2 build (its factor, 256 KB, cannot be
    staged); fb: the chains of 32-channel feedback blocks side by side."""
    from zerodram.kernels.jit import compile_cubin
    from zerodram.kernels.kv_write import DecodeWriteConfig

    cfg = DecodeWriteConfig(d, *blocks, "e4m3", feedback_block=fb)
    assert (cfg.factor_smem_bytes > 0) == (d <= 128)
    for staged in (False, True) if cfg.factor_smem_bytes else (False,):
        assert compile_cubin("fp2_decode_write", cfg.build_options(staged))


def test_mirrored_decode_plan_equals_planning_every_layer() -> None:
    """A partition plans a decode step on layer 0 and mirrors it on the others: the same pages and
    lengths as planning each layer, and a layer that has parted (another length, other pages)
    raises instead of writing where the plan says."""
    fmt = "fp2:tail=1,window=32"
    lead, own, mirror = (make_cache(fmt, num_pages=24, max_seqs=6) for _ in range(3))
    seqs = []
    for n0 in (0, 3, 31, 46, 63, 90):
        for c in (lead, own, mirror):
            sid = c.new_sequence()
            if n0:
                c.append(sid, *kv_tokens(n0, seed=n0))
        seqs.append(sid)
    for step in range(70):
        live = [s for i, s in enumerate(seqs) if step < 40 or i % 2]
        assert own.plan_decode_static(live) == lead.plan_decode_static(live)
        mirror.mirror_decode_static(live, lead, live)
        assert mirror.tables.pages == own.tables.pages and mirror.tables.lens == own.tables.lens
    other = make_cache(fmt, num_pages=24, max_seqs=6)
    other.new_sequence()  # a slot the lead does not have: this layer keeps seqs[0] in slot 1
    with pytest.raises(ZerodramError, match=r"slot 1, layer 0 in slot 0: .*parted"):
        other.mirror_decode_static([1], lead, [seqs[0]])
    one = [seqs[1]]  # at 73 tokens
    mirror.tables.lens[one[0]] -= 1
    lead.plan_decode_static(one)
    with pytest.raises(ZerodramError, match=r"holds 72 tokens, layer 0's 73: .*parted"):
        mirror.mirror_decode_static(one, lead, one)
    mirror.tables.lens[one[0]] = lead.tables.lens[one[0]]
    mirror.allocator.allocate(1)  # the mirror's pool moves alone: its next page differs
    while len(lead.tables.pages[one[0]]) == len(mirror.tables.pages[one[0]]):
        lead.plan_decode_static(one)
        if len(lead.tables.pages[one[0]]) == len(mirror.tables.pages[one[0]]):
            mirror.mirror_decode_static(one, lead, one)
    with pytest.raises(ZerodramError, match=r"holds pages .*parted"):
        mirror.mirror_decode_static(one, lead, one)


def test_decode_append_refuses_and_writes_nothing() -> None:
    c = make_cache("fp2", num_pages=3, layer_idx=2)
    s0, s1 = c.new_sequence(), c.new_sequence()
    k, v = kv_tokens(40)
    c.append(s0, k, v)
    before = [t.clone() for t in _state(c)]
    bad = torch.zeros(2, H, D)
    bad[1, 1, 7] = float("nan")
    with pytest.raises(KVInputError, match=r"layer 2, KV head 1, position 0"):
        c.append_decode([s0, s1], torch.zeros(2, H, D), bad)
    with pytest.raises(KVInputError, match="twice"):
        c.append_decode([s0, s0], torch.zeros(2, H, D), torch.zeros(2, H, D))
    with pytest.raises(KVInputError, match=r"\[2, H, D\]"):
        c.append_decode([s0, s1], torch.zeros(3, H, D), torch.zeros(3, H, D))
    assert (c.seq_len(s0), c.seq_len(s1)) == (40, 0)
    assert all(torch.equal(x, y) for x, y in zip(before, _state(c), strict=True))


@pytest.mark.parametrize("fmt", ["bf16", "fp2"])
def test_decode_append_zero_mode_flags_rows_without_raising(fmt: str) -> None:
    """on_nonfinite="zero": no exception and no host sync; the bad row is stored as zeros (what an
    append of zeros stores) and flagged, the other rows are stored as given."""
    a, b = make_cache(fmt, num_pages=8), make_cache(fmt, num_pages=8)
    s = [a.new_sequence(), a.new_sequence()]
    assert s == [b.new_sequence(), b.new_sequence()]
    k, v = kv_tokens(2, seed=9)
    bad_k = k.clone()
    bad_k[1, 0, 3] = float("nan")
    flags = a.append_decode(s, bad_k, v, on_nonfinite="zero")
    assert flags.tolist() == [False, True]
    clean_k = k.clone()
    clean_k[1, 0, 3] = 0.0
    b.append_decode(s, clean_k, v)
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b), strict=True))
    with pytest.raises(ConfigError, match="on_nonfinite"):
        a.append_decode(s, k, v, on_nonfinite="skip")


def test_feedback_codes_without_division_match_the_division() -> None:
    """fp2_decode_write.cu's fast pass (`feedback_codes`): a code from the signs of
    r_i = fma(-s, m_i, v), and a re-run with divisions wherever some r_i lies in (-tol_i, -0]
    (tol_i = max(s |m_i| 2^-21, s 2^-148, 2^-125), tested on the bits as the kernel does). Its codes
    must be the torch body's, bucketize(v / s, midpoints, right=True), on values placed within a
    few ulps of every s m_i (where the rounded quotient can land on m_i), zeros, tiny values beside
    m_i = 0 and subnormal midpoints at huge and tiny scales (quotients rounding to -0, r_i
    underflowing to -0), NaN and inf, and at random; e4m3, E8M0 over its whole range and
    full-mantissa scales; the format's levels and full-mantissa ones. The fma is emulated in fp64
    (s m_i exact there), rounded once to fp32."""
    import numpy as np

    from zerodram.runtime.kv.levels import midpoints, named_levels
    from zerodram.runtime.kv.scales import round_scale

    rng = np.random.default_rng(11)
    f32, u32 = np.float32, np.uint32
    e8m0 = np.array([2.0**e for e in (-127, -100, -30, -9, -1, 0, 5, 24, 25, 30, 100, 126, 127)], dtype=f32)
    level_sets = {
        "lm": named_levels("lm").float(),
        "sig": named_levels("sig").float(),
        "any": torch.sort(torch.randn(4, dtype=torch.float32)).values,
        "tiny": torch.tensor([-(2.0**-130), -(2.0**-149), 2.0**-148, 2.0**-131], dtype=torch.float32),
    }
    reruns = total = 0
    for name, lv in level_sets.items():
        m = midpoints(lv).numpy().astype(f32)  # [3]
        for scale_dtype in ("e4m3", "e8m0", "any"):
            s = rng.uniform(2.0**-9, 400.0, 48).astype(f32)
            if scale_dtype != "any":
                s = round_scale(torch.from_numpy(s), scale_dtype).numpy()
            extra = {"e4m3": [2.0**-9, 448.0], "e8m0": e8m0, "any": [1e-30, 3e30]}[scale_dtype]
            for si in np.concatenate([s, np.asarray(extra, dtype=f32)]):
                with np.errstate(all="ignore"):
                    prod = (si.astype(np.float64) * m.astype(np.float64)).astype(f32)  # [3]
                    near = (prod[:, None] * (1 + np.arange(-40, 41)[None, :] * 2.0**-24)).astype(f32).ravel()
                    steps = np.concatenate([np.nextafter(prod, f32(np.inf)), np.nextafter(prod, f32(-np.inf))])
                    under = si.astype(np.float64) * 2.0**-150 * np.array([0.5, 1, 1.5, 2, 4, 1e3])  # quotients near -0
                    tiny = np.concatenate([-under, under, [2.0**-149, 2.0**-125, 1e-30]]).astype(f32)
                    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf], dtype=f32)
                    v = np.concatenate([near, steps, prod, -tiny, tiny, special, rng.normal(0, 3 * si, 300).astype(f32)])
                    want = (~((v / si)[:, None] < m[None, :])).sum(1)  # fp32 IEEE division, as torch's
                    r = (v.astype(np.float64)[:, None] - si.astype(np.float64) * m[None, :].astype(np.float64)).astype(f32)
                    got = (~(r < 0)).sum(1)
                    tol = np.maximum(np.maximum(si * np.abs(m) * f32(2.0**-21), si * f32(2.0**-126) * f32(2.0**-22)),
                                     f32(2.0**-125)).astype(f32)  # [3]
                    rerun = ((r.view(u32) ^ u32(0x80000000)) < tol.view(u32)[None, :]).any(1)
                bad = (got != want) & ~rerun
                assert not bad.any(), (name, scale_dtype, si, v[bad][:4])
                reruns, total = reruns + int(rerun.sum()), total + len(v)
    assert reruns < 0.1 * total  # the band is narrow (the values above crowd it on purpose)


def test_feedback_blocks_refuse_a_factor_across_them() -> None:
    """`fbblk`: a factor that reaches past the format's blocks is refused when set (a writer may run
    the blocks apart, so it would be silently cut); one zero between the blocks is taken. The
    decode-write kernel takes only blocks of whole chain steps inside both sides' scale blocks
    (`unsupported`, no GPU needed)."""
    import dataclasses

    from zerodram.kernels.kv_write import unsupported

    c = make_cache("fp2:fb=1,fbblk=32,tail=1,window=47")
    dense = (torch.eye(D) + 0.1 * torch.ones(D, D).triu(1)).expand(H, D, D)
    with pytest.raises(ConfigError, match="reaches past"):
        c.params = tuple(dataclasses.replace(p, feedback=dense) for p in c.params)
    blk = torch.arange(D) // 32
    c.params = tuple(dataclasses.replace(p, feedback=dense * (blk[:, None] == blk[None, :])) for p in c.params)
    ok = ((64, 64), ("e4m3", "e4m3"), ("mse", "mse"))
    assert unsupported(128, *ok, 32) is None and unsupported(128, *ok, 0) is None
    assert "feedback blocks" in unsupported(128, *ok, 48) and "feedback blocks" in unsupported(128, (32, 64), *ok[1:], 64)


def test_decode_write_config_takes_the_blocks_of_the_sides_with_feedback() -> None:
    """`decode_write_config`, the build the cache and `bench attention --write-kv` share: one block
    width for both sides (a block of the whole head is none; a side without feedback has none),
    and blocks that differ between the sides refused with the reason (no GPU needed)."""
    from zerodram.runtime.kv.format import parse_kv_spec
    from zerodram.runtime.kv.fp2_decode_write import decode_write_config

    def config(kv: str, d: int = 128):
        return decode_write_config(parse_kv_spec(kv).spec, d, v_quad=True)

    cfg, why = config("fp2:fb=1,fbblk=32,tail=1,window=47")
    assert why is None and (cfg.feedback_block, cfg.head_dim, cfg.k_block, cfg.v_quad) == (32, 128, 64, True)
    assert config("fp2:fb=1,fbblk=128,tail=1,window=47")[0].feedback_block == 0
    assert config("fp2:fb=1,tail=1,window=47")[0].feedback_block == 0
    assert config("fp2:kfb=1,fbblk=32,tail=1,window=47")[0].feedback_block == 32  # the bare fbblk: keys only
    cfg, why = config("fp2:kfb=1,vfb=1,kfbblk=32,vfbblk=64,tail=1,window=47")
    assert cfg is None and "differ between keys and values" in why
    cfg, why = config("fp2:fb=1,fbblk=16,tail=1,window=47", d=256)  # chain steps of 8: 16 is two
    assert why is None and cfg.feedback_block == 16
    assert "feedback blocks of 4 " in config("fp2:fb=1,fbblk=4,tail=1,window=47")[1]  # under a chain step
    # D = 96: chain steps of 24 channels, which 32-channel scale blocks do not hold whole
    assert "feedback blocks of 24 " in config("fp2:fb=1,fbblk=24,blk=c32,tail=1,window=47", d=96)[1]
