"""The NVSHMEM backend on a GPU: 1 PE, and 2 and 4 PEs sharing one GPU, under the CPU tests' checks.

Ranks come from `run_ranks` on gloo (CPU context); each then binds cuda:0 and initialises NVSHMEM
over that group (NCCL refuses several ranks on one GPU). Kernels of different processes time-slice
on one GPU: correct, not fast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from multirank import run_ranks

from zerodram.runtime.comm import EpLayout, ExpertPlacement
from zerodram.runtime.errors import RankTimeoutError
from zerodram.runtime.moe import (
    EpMoELayer,
    MoEWeights,
    RouterConfig,
    gate_logits,
    reference_experts,
    route,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

D, F, TM = 256, 128, 24


@dataclass(frozen=True)
class _GpuCtx:
    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout_s: float


def _gpu_ctx(ctx, timeout_s: float = 20.0) -> _GpuCtx:
    torch.cuda.set_device(0)
    return _GpuCtx(ctx.rank, ctx.world_size, torch.device("cuda", 0), ctx.backend, timeout_s)


# name, E, K, tokens per rank, routing, scoring, wire, replicas
CASES = [
    ("topk2_given", 8, 2, (5, 9, 0, 3), "topk", "softmax", "bf16", False),
    ("topk1_logits", 8, 1, (7, 7, 7, 7), "logits", "softmax", "bf16", False),
    ("topk8_gate_sigmoid", 16, 8, (4, 1, 6, 2), "gate", "sigmoid", "bf16", False),
    ("one_expert", 8, 1, (6, 3, 5, 1), "one", "softmax", "bf16", False),
    ("masked", 8, 2, (4, 4, 4, 4), "masked", "softmax", "bf16", False),
    ("all_empty", 8, 2, (0, 0, 0, 0), "topk", "softmax", "bf16", False),
    ("fp8_gate", 16, 2, (TM, 2, 9, 4), "gate", "softmax", "fp8", False),
    ("replicas_ring", 8, 2, (9, 5, 7, 3), "topk", "softmax", "bf16", True),
]


def _inputs(i: int, W: int, counts, E: int, K: int, kind: str):
    g = torch.Generator().manual_seed(50 + i)
    out = []
    for r in range(W):
        T = counts[r % len(counts)]
        x = torch.randn(T, D, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
        idx = idx.to(torch.int64)
        if kind == "one":
            idx[:] = 3
        if kind == "masked":
            idx[::2, K - 1] = -1
        out.append((x, idx, torch.rand(T, K, generator=g)))
    return out


def _placement(rank: int, W: int, E: int, replicas: bool) -> ExpertPlacement:
    base = ExpertPlacement.contiguous(rank, W, E)
    if not replicas:
        return base
    reps = tuple(((base.expert_to_rank[e] + 1) % W,) if e % 2 == 0 and W > 1 else () for e in range(E))
    return ExpertPlacement(rank, W, base.expert_to_rank, reps, tuple((rank - s) % W for s in range(W)))


def _nvshmem_cases(ctx) -> list[str]:
    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm
    from zerodram.runtime.comm.nvshmem_session import NvshmemSession

    gctx = _gpu_ctx(ctx)
    W, rank, dev = gctx.world_size, gctx.rank, gctx.device
    session = NvshmemSession.create(gctx, heap_bytes=1 << 30)
    done = []
    try:
        for i, (name, E, K, counts, kind, scoring, wire, replicas) in enumerate(CASES):
            weights = MoEWeights.random(E, D, F, seed=200 + i, dtype=torch.bfloat16, device=dev)
            router = RouterConfig(E, K, scoring=scoring, renormalize=scoring == "softmax")
            layout = EpLayout(_placement(rank, W, E, replicas), D, K, TM, wire)
            comm = NvshmemComm.create(gctx, layout, router, session=session)
            layer = EpMoELayer(comm, weights.shard(layout.local_experts), gate_weight=weights.gate_weight)
            x, idx, w = (t.to(dev) for t in _inputs(i, W, counts, E, K, kind)[rank])
            for _repeat in range(3):  # both phases, and a phase reused
                if kind == "gate":
                    y = layer.forward(x)
                    ref_idx, ref_w = route(gate_logits(x, weights.gate_weight), router)
                elif kind == "logits":
                    logits = gate_logits(x, weights.gate_weight)
                    out = comm.dispatch(x, logits=logits)
                    from zerodram.runtime.moe import grouped_swiglu

                    y = comm.combine(grouped_swiglu(out.recv_x, out.recv_expert_offsets, layer.experts), out)
                    ref_idx, ref_w = route(logits, router)
                    assert torch.equal(out.topk_idx, ref_idx), f"{name}: fused router chose differently"
                    torch.testing.assert_close(out.topk_weight, ref_w, atol=1e-5, rtol=1e-4)
                else:
                    y = layer(x, idx, w)
                    ref_idx, ref_w = idx, w
                comm.check()
                ref = reference_experts(x.float(), ref_idx, ref_w, _float(weights)).to(torch.bfloat16)
                tol = 8e-2 if wire == "fp8" else 3e-2
                torch.testing.assert_close(
                    y, ref, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n} rank {rank}: {m}"
                )
            comm.close()
            done.append(name)
        _self_checking_rows(gctx, session)
        done.append("self_checking_rows")
    finally:
        session.close()
    return done


def _float(w: MoEWeights) -> MoEWeights:
    return MoEWeights(w.gate_weight.float(), w.w_gate.float(), w.w_up.float(), w.w_down.float())


def _self_checking_rows(gctx: _GpuCtx, session) -> None:
    """Rows carry (src rank, token); identity experts; combine must give K * x back."""
    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm

    W, rank, dev, E, K = gctx.world_size, gctx.rank, gctx.device, 8, 2
    layout = EpLayout(ExpertPlacement.contiguous(rank, W, E), D, K, TM)
    comm = NvshmemComm.create(gctx, layout, session=session)
    g = torch.Generator().manual_seed(5)
    topks = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(TM - r)]) for r in range(W)]
    T = topks[rank].shape[0]
    x = torch.zeros(T, D, dtype=torch.bfloat16, device=dev)
    x[:, 0], x[:, 1] = rank, torch.arange(T, device=dev).to(torch.bfloat16)
    out = comm.dispatch(x, topk_idx=topks[rank].to(dev), topk_weight=torch.ones(T, K, device=dev))
    y = comm.combine(out.recv_x, out)
    comm.check()
    ends, start = out.recv_expert_offsets.tolist(), 0
    for le, e in enumerate(layout.local_experts):
        seg = out.recv_x[start : ends[le]].float().cpu()
        assert seg.shape[0] == sum(int((t == e).sum()) for t in topks), (e, seg.shape)
        got = sorted(zip(seg[:, 0].long().tolist(), seg[:, 1].long().tolist(), strict=True))
        want = sorted((s, t) for s in range(W) for t in range(topks[s].shape[0]) if e in topks[s][t].tolist())
        assert got == want, f"expert {e}: rows {got[:6]}... expected {want[:6]}..."
        start = ends[le]
    torch.testing.assert_close(y.float(), x.float() * K)
    comm.close()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_nvshmem_layer_matches_reference(world_size: int) -> None:
    results = run_ranks(_nvshmem_cases, world_size, timeout_s=400, rank_timeout_s=120, device="cpu")
    assert all(r == [c[0] for c in CASES] + ["self_checking_rows"] for r in results)


def _device_timeout(ctx, silent: int) -> str:
    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm

    gctx = _gpu_ctx(ctx, timeout_s=1.0)
    layout = EpLayout(ExpertPlacement.contiguous(gctx.rank, gctx.world_size, 4), D, 1, 4)
    comm = NvshmemComm.create(gctx, layout)
    msg = "silent"
    if gctx.rank != silent:
        t0 = time.monotonic()
        x = torch.zeros(2, D, dtype=torch.bfloat16, device=gctx.device)
        idx = torch.tensor([[0], [3]], device=gctx.device)
        out = comm.dispatch(x, topk_idx=idx, topk_weight=torch.ones(2, 1, device=gctx.device))
        try:
            comm.check()
            msg = "no error"
        except RankTimeoutError as err:
            msg = f"{time.monotonic() - t0:.1f}s {err}"
        del out
    comm.close()
    return msg


def test_silent_pe_is_named_by_the_device_wait() -> None:
    results = run_ranks(_device_timeout, 2, args=(1,), timeout_s=120, rank_timeout_s=60, device="cpu")
    assert results[1] == "silent"
    assert "from rank 1" in results[0], results[0]
    assert "dispatch rows" in results[0], results[0]
    assert float(results[0].split("s ", 1)[0]) < 10, results[0]


def _graph_replays(ctx) -> int:
    """The whole EP layer (fused router, dispatch, grouped experts, combine) captured once in a
    CUDA graph and replayed on fresh inputs: nothing on the path may sync with the host."""
    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm
    from zerodram.runtime.comm.nvshmem_session import NvshmemSession

    gctx = _gpu_ctx(ctx)
    W, rank, dev, E, K = gctx.world_size, gctx.rank, gctx.device, 8, 2
    session = NvshmemSession.create(gctx, heap_bytes=1 << 28)
    try:
        weights = MoEWeights.random(E, D, F, seed=31, dtype=torch.bfloat16, device=dev)
        router = RouterConfig(E, K, scoring="softmax", renormalize=True)
        layout = EpLayout(ExpertPlacement.contiguous(rank, W, E), D, K, TM)
        comm = NvshmemComm.create(gctx, layout, router, session=session)
        layer = EpMoELayer(comm, weights.shard(layout.local_experts), gate_weight=weights.gate_weight)
        x = torch.randn(TM - rank, D, device=dev).to(torch.bfloat16)
        for _ in range(2):  # compile and load every kernel outside the capture
            layer.forward(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = [layer.forward(x), layer.forward(x)]  # both phases: replays find the phase they expect
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            x.copy_(torch.randn(x.shape, generator=g).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            comm.check()
            idx, w = route(gate_logits(x, weights.gate_weight), router)
            ref = reference_experts(x.float(), idx, w, _float(weights)).to(torch.bfloat16)
            for y in ys:
                torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)
        comm.close()
    finally:
        session.close()
    return 3


@pytest.mark.parametrize("world_size", [1, 2])
def test_ep_layer_replays_from_a_cuda_graph(world_size: int) -> None:
    results = run_ranks(_graph_replays, world_size, timeout_s=300, rank_timeout_s=120, device="cpu")
    assert results == [3] * world_size


NAN, INF = float("nan"), float("inf")


def _edge_logits(E: int, seed: int) -> torch.Tensor:
    """[TM, E] rows that once broke the fused router, then rows with NaN sprinkled among numbers.
    Its self-check: each named row's expected ids are written out beside it (K = 4)."""
    rows = torch.randn(TM, E, generator=torch.Generator().manual_seed(seed))  # [TM, E]
    rows[0] = NAN  # every comparison false: the argmax found no expert, an index of INT_MAX
    rows[1] = NAN
    rows[1, E - 1], rows[1, 3] = 1.0, -INF  # -> E-1, 3, then NaNs by id: 0, 1
    rows[2, ::2] = NAN  # enough numbers: no NaN chosen
    rows[3] = -INF  # -> 0, 1, 2, 3, each once (a chosen expert was marked -inf and chosen again)
    rows[4] = -INF
    rows[4, 6] = 0.0  # -> 6, 0, 1, 2
    rows[5] = -1000.0 - torch.arange(E)  # sigmoid scores all 0: renormalisation was 0 / 0
    rows[6] = -1.0
    rows[6, 5], rows[6, 2], rows[6, E - 1] = -0.0, 0.0, -0.0  # -> 2, 5, E-1, 0 (-0 ties +0)
    mask = torch.rand(TM, E, generator=torch.Generator().manual_seed(seed + 1)) < 0.3
    rows[8:][mask[8:]] = NAN
    return rows


EDGE_IDS = {0: [0, 1, 2, 3], 1: ["last", 3, 0, 1], 3: [0, 1, 2, 3], 4: [6, 0, 1, 2], 6: [2, 5, "last", 0]}


def _router_edge_rows(ctx) -> int:
    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm
    from zerodram.runtime.comm.nvshmem_session import NvshmemSession

    gctx = _gpu_ctx(ctx)
    W, rank, dev, K = gctx.world_size, gctx.rank, gctx.device, 4
    session = NvshmemSession.create(gctx, heap_bytes=1 << 28)
    checked = 0
    try:
        for E in (8, 40):  # fewer experts than lanes; some lanes with two experts, some with one
            logits = _edge_logits(E, 300 + 10 * rank + E).to(dev)  # [TM, E]
            x = torch.randn(TM, D, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(dev)
            for scoring, renormalize in (("softmax", True), ("sigmoid", True), ("sigmoid", False)):
                router = RouterConfig(E, K, scoring=scoring, renormalize=renormalize)
                layout = EpLayout(ExpertPlacement.contiguous(rank, W, E), D, K, TM)
                comm = NvshmemComm.create(gctx, layout, router, session=session)
                out = comm.dispatch(x, logits=logits)
                y = comm.combine(out.recv_x, out)  # identity experts: y[t] = sum_k w[t, k] * x[t]
                comm.check()
                what = f"E={E} {scoring} renormalize={renormalize} rank {rank}"
                ref_idx, ref_w = route(logits, router)
                for t, ids in EDGE_IDS.items():
                    assert ref_idx[t].tolist() == [E - 1 if i == "last" else i for i in ids], (what, t)
                assert torch.equal(out.topk_idx, ref_idx), f"{what}: fused router chose differently"
                torch.testing.assert_close(
                    out.topk_weight, ref_w, atol=1e-5, rtol=1e-4, equal_nan=True, msg=what
                )
                if renormalize and scoring == "sigmoid":
                    assert torch.equal(out.topk_weight[5], torch.zeros(K, device=dev)), what
                ref_y = (ref_w.sum(-1, keepdim=True) * x.float()).to(torch.bfloat16)
                torch.testing.assert_close(y, ref_y, atol=3e-2, rtol=3e-2, equal_nan=True, msg=what)
                comm.close()
                checked += 1
    finally:
        session.close()
    return checked


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_router_edge_rows_match_reference(world_size: int) -> None:
    """NaN and -inf logits, signed zeros, underflowed sigmoid scores: ids equal to `route`'s, weights
    too (NaN where it is NaN), and the rows go through dispatch and combine."""
    results = run_ranks(_router_edge_rows, world_size, timeout_s=300, rank_timeout_s=120, device="cpu")
    assert results == [6] * world_size


@pytest.mark.parametrize("T", [1, 7, 128])
def test_gate_logits_gemm_matches_the_widened_product(T: int) -> None:
    """bf16 operands on the GPU: one GEMM with fp32 output. Against the products summed in fp64,
    within fp32 rounding of sums of D terms (|logit| ~ 1 here); fresh random data per size."""
    g = torch.Generator().manual_seed(T)
    E, Dh = 256, 7168
    x = torch.randn(T, Dh, generator=g).bfloat16()  # [T, D]
    w = (torch.randn(E, Dh, generator=g) / Dh**0.5).bfloat16()  # [E, D]
    got = gate_logits(x.cuda(), w.cuda())  # [T, E]
    want = x.double() @ w.double().t()  # [T, E]
    assert got.dtype == torch.float32 and got.shape == (T, E)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)
