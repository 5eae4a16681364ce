"""Dispatch alone, host-driven path, over gloo: every received row says where it came from.

Row t of rank r carries (r, t) in its first two channels; the receiver checks that each packed row
sits in the segment of an expert that token really chose, in expert-major / source-minor order,
and that per-expert counts match a recount from the shared seed. Also: a rank that skips the
collective makes the others raise `RankTimeoutError` naming it, within seconds; and rows of
another dtype than the layout's are refused on the rank that passes them, before anything is sent.
"""

from __future__ import annotations

import time

import pytest
import torch
from multirank import run_ranks

from zerodram.runtime.comm import EpLayout, ExpertPlacement, create_communicator
from zerodram.runtime.comm.torch_dist import TorchDistComm
from zerodram.runtime.errors import ConfigError, RankTimeoutError

pytestmark = pytest.mark.slow

D, E, K, TM = 16, 8, 2, 10


def _topk(seed: int, W: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(W):
        T = 0 if r == W - 1 else (3 * r + 4) % (TM + 1)  # uneven; the last rank sends nothing
        out.append(
            torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
        )
    return [t.to(torch.int64) for t in out]


def _dispatch_only(ctx) -> int:
    W, rank = ctx.world_size, ctx.rank
    placement = ExpertPlacement.contiguous(rank, W, E)
    layout = EpLayout(placement, D, K, TM, dtype=torch.float32)
    comm = create_communicator(ctx, layout, backend="torch")
    topks = _topk(11, W)
    idx = topks[rank]
    T = idx.shape[0]
    x = torch.zeros(T, D)
    x[:, 0] = rank
    x[:, 1] = torch.arange(T, dtype=torch.float32)
    out = comm.dispatch(x, topk_idx=idx, topk_weight=torch.ones(T, K))
    ends = out.recv_expert_offsets.tolist()
    start, checked = 0, 0
    for le, e in enumerate(layout.local_experts):
        seg = out.recv_x[start : ends[le]]
        want = sum(int((topks[s] == e).sum()) for s in range(W))
        assert seg.shape[0] == want == int(out.recv_num_tokens_per_expert[le]), (e, seg.shape, want)
        src = seg[:, 0].long()
        assert torch.all(src[1:] >= src[:-1]), f"expert {e}: rows not source-ordered: {src.tolist()}"
        for s, t in zip(src.tolist(), seg[:, 1].long().tolist(), strict=True):
            assert e in topks[s][t].tolist(), (
                f"expert {e} got token {t} of rank {s}, which chose {topks[s][t]}"
            )
            checked += 1
        pairs = {(s, t) for s, t in zip(src.tolist(), seg[:, 1].long().tolist(), strict=True)}
        assert len(pairs) == seg.shape[0], f"expert {e}: a row arrived twice"
        start = ends[le]
    # and the combine returns every row to its source: y = sum_k 1 * x (identity experts)
    y = comm.combine(out.recv_x, out)
    torch.testing.assert_close(y, x * K)
    comm.close()
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_rows_arrive_where_the_protocol_says(world_size: int) -> None:
    checked = run_ranks(_dispatch_only, world_size, timeout_s=60, rank_timeout_s=20)
    assert sum(checked) == sum(int((t >= 0).sum()) for t in _topk(11, world_size))


def _one_rank_skips(ctx, skipper: int, wait_s: float) -> str:
    placement = ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E)
    comm = create_communicator(ctx, EpLayout(placement, D, K, TM, dtype=torch.float32), backend="torch")
    comm.timeout_s = wait_s
    if ctx.rank == skipper:
        time.sleep(wait_s + 1.5)  # alive but silent: the others must not hang on it
        return "skipped"
    t0 = time.monotonic()
    try:
        comm.dispatch(
            torch.zeros(2, D), topk_idx=torch.arange(K).repeat(2, 1), topk_weight=torch.ones(2, K)  # experts 0..K-1
        )
    except RankTimeoutError as err:
        return f"{time.monotonic() - t0:.1f}s {err}"
    return "no error"


def test_silent_rank_is_named_within_the_timeout() -> None:
    results = run_ranks(_one_rank_skips, 3, args=(2, 2.0), timeout_s=60, rank_timeout_s=30)
    assert results[2] == "skipped"
    for msg in results[:2]:
        assert "rank 2" in msg, msg
        assert "dispatch counts" in msg, msg
        assert float(msg.split("s ", 1)[0]) < 6.0, msg
        assert "(limit 2s)" in msg, msg


def _late_after_the_peer_left(ctx) -> str:
    placement = ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E)
    comm = create_communicator(ctx, EpLayout(placement, D, K, TM, dtype=torch.float32), backend="torch")
    if ctx.rank == 0:
        return "left"  # its process group closes with the process
    time.sleep(2.0)  # late: rank 0 is gone by now, so posting the counts fails at once
    try:
        comm.dispatch(
            torch.zeros(2, D), topk_idx=torch.arange(K).repeat(2, 1), topk_weight=torch.ones(2, K)  # experts 0..K-1
        )
    except RankTimeoutError as err:
        return str(err)
    return "no error"


def test_a_late_rank_whose_peer_left_gets_a_rank_timeout_error_saying_when() -> None:
    # a bare RuntimeError here would escape the worker's error line as a traceback
    results = run_ranks(_late_after_the_peer_left, 2, timeout_s=60, rank_timeout_s=20)
    assert results[0] == "left"
    msg = results[1]
    assert msg.startswith("rank 1/2: waiting for "), msg
    assert "the dispatch counts exchange with rank 0 failed after 0." in msg, msg  # at posting, at once
    assert "(limit 20s)" in msg, msg


def test_all_to_all_errors_state_the_bound_that_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective is bounded by its process group's timeout, not the communicator's."""

    def reset(*args, **kwargs):
        raise RuntimeError("Connection reset by peer\nmore lines")

    monkeypatch.setattr("torch.distributed.all_to_all_single", reset)
    comm = TorchDistComm(
        EpLayout(ExpertPlacement.contiguous(0, 2, E), D, K, TM), None, torch.device("cpu"), "gloo", 5.0, None
    )
    with pytest.raises(RankTimeoutError) as info:
        comm._all_to_all(torch.empty(0), torch.empty(0), [0, 0], [0, 0], "combine rows")
    assert str(info.value).startswith("rank 0/2: waiting for combine rows (all_to_all) failed after 0.0s")
    assert str(info.value).endswith("(limit: the process group's timeout): Connection reset by peer")


def test_precomputed_routing_is_checked_before_anything_is_sent() -> None:
    """Shapes and dtypes of topk_idx / topk_weight, logits and the router against the layout, and
    (host tensors) ids below E and no expert twice in a token: a pair holds one slot per token."""
    from zerodram.runtime.comm.base import _check_topk

    T, ok = 3, torch.tensor([[0, 1], [2, -1], [3, 0]])
    _check_topk(ok, torch.ones(T, K), T, K, E)
    for idx, weight, message in (
        (ok.float(), torch.ones(T, K), "integers"),
        (ok, torch.ones(T, 1), r"topk_weight \(3, 1\)"),
        (ok, None, "topk_weight none"),
        (torch.tensor([[0, 1], [2, E], [3, 0]]), torch.ones(T, K), f"names expert {E}"),
        (torch.tensor([[0, 1], [2, 2], [3, 0]]), torch.ones(T, K), r"token 1 picks an expert twice: \[2, 2\]"),
    ):
        with pytest.raises(ConfigError, match=message):
            _check_topk(idx, weight, T, K, E)
    _check_topk(torch.tensor([[-1, -1]] * T), torch.ones(T, K), T, K, E)  # masked twice is no expert


def _rows_of_another_dtype(ctx) -> dict:
    """Every rank passes rows of the wrong dtype (dispatch's x, then combine's expert_out): every
    rank raises before sending, so the ranks stay in step and the next calls are served."""
    layout = EpLayout(ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E), D, K, TM)  # bf16 rows
    comm = create_communicator(ctx, layout, backend="torch")
    comm.timeout_s = 10.0
    T = 3
    x = torch.full((T, D), float(ctx.rank + 1), dtype=torch.bfloat16)  # [T, D]
    idx = torch.tensor([[0, 4], [1, 5], [6, 2]])  # [T, K] experts of both ranks
    route = {"topk_idx": idx, "topk_weight": torch.ones(T, K)}
    got = {}
    with pytest.raises(ConfigError) as info:
        comm.dispatch(x.float(), **route)
    got["dispatch"] = str(info.value)
    out = comm.dispatch(x, **route)
    with pytest.raises(ConfigError) as info:
        comm.combine(out.recv_x.float(), out)
    got["combine"] = str(info.value)
    y = comm.combine(out.recv_x, out)  # identity experts: y = sum_k 1 * x
    assert y.dtype == torch.bfloat16 and torch.equal(y, x * K), y
    comm.close()
    return got


def test_rows_of_another_dtype_are_refused_on_every_rank_before_anything_is_sent() -> None:
    for rank, got in enumerate(run_ranks(_rows_of_another_dtype, 2, timeout_s=60, rank_timeout_s=20)):
        assert got["dispatch"] == (
            f"rank {rank}/2: dispatch's x is [3, {D}] torch.float32, the layout expects [T, {D}] "
            "torch.bfloat16 (fixed at construction, the same on every rank)"
        )
        assert got["combine"].startswith(f"rank {rank}/2: combine's expert_out is [")
        assert "torch.float32, the layout expects [" in got["combine"], got["combine"]


def _ranks_with_different_dtypes(ctx) -> str:
    """The reviewer's case: rank 0 dispatches bf16 rows, rank 1 fp32 rows. Before the rows were
    checked against the layout, rank 1 decoded rank 0's bf16 bytes as fp32 garbage and gloo
    aborted rank 0 (`op.preamble.length <= op.nbytes. 192 vs 96`)."""
    layout = EpLayout(ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E), D, K, TM)  # bf16 rows
    comm = create_communicator(ctx, layout, backend="torch")
    comm.timeout_s = 5.0
    T = 3
    x = torch.ones(T, D, dtype=torch.bfloat16 if ctx.rank == 0 else torch.float32)  # [T, D]
    idx = torch.tensor([[0, 4], [1, 5], [6, 2]])  # [T, K] experts of both ranks
    try:
        comm.dispatch(x, topk_idx=idx, topk_weight=torch.ones(T, K))
    except (ConfigError, RankTimeoutError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_ranks_dispatching_different_dtypes_get_errors_not_garbage() -> None:
    """Rank 1 (fp32 rows, bf16 layout) refuses them by name before sending anything; rank 0,
    whose rows match, ends its bounded wait for rank 1's counts naming rank 1. No abort: a rank
    that died without reporting would fail `run_ranks` with its exit code."""
    rank0, rank1 = run_ranks(_ranks_with_different_dtypes, 2, timeout_s=60, rank_timeout_s=20)
    assert rank1 == (
        f"ConfigError: rank 1/2: dispatch's x is [3, {D}] torch.float32, the layout expects [T, {D}] "
        "torch.bfloat16 (fixed at construction, the same on every rank)"
    )
    assert rank0.startswith("RankTimeoutError: rank 0/2: waiting for "), rank0
    assert "dispatch counts" in rank0 and "rank 1" in rank0, rank0


def test_rows_are_checked_against_the_layout() -> None:
    """`check_rows`, shared by both backends: width, row count (combine) and dtype, naming the rank
    and both sides; a layout fixes its rows' dtype (and with it the row's bytes on the wire)."""
    from types import SimpleNamespace

    from zerodram.runtime.comm.base import check_rows
    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm
    from zerodram.runtime.moe.experts import ExpertShard
    from zerodram.runtime.moe.layer import EpMoELayer

    lay = EpLayout(ExpertPlacement.contiguous(1, 2, E), D, K, TM)
    assert lay.dtype == torch.bfloat16 and lay.msg_bytes == 2 * D
    check_rows(torch.zeros(3, D, dtype=torch.bfloat16), lay, "x")
    check_rows(torch.zeros(0, D, dtype=torch.bfloat16), lay, "x")  # a rank without tokens
    check_rows(torch.zeros(5, D, dtype=torch.bfloat16), lay, "y", 5)
    for rows, num_rows, message in (
        (torch.zeros(3, D), None, rf"rank 1/2: x is \[3, {D}\] torch.float32, the layout expects \[T, {D}\] torch.bfloat16"),
        (torch.zeros(3, D, dtype=torch.float16), None, "x is .* torch.float16, the layout expects .* torch.bfloat16"),
        (torch.zeros(3, D + 8, dtype=torch.bfloat16), None, rf"x is \[3, {D + 8}\] torch.bfloat16, the layout expects \[T, {D}\]"),
        (torch.zeros(3 * D, dtype=torch.bfloat16), None, rf"x is \[{3 * D}\]"),
        (torch.zeros(4, D, dtype=torch.bfloat16), 5, rf"x is \[4, {D}\] torch.bfloat16, the layout expects \[5, {D}\]"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            check_rows(rows, lay, "x", num_rows)
    lay32 = EpLayout(lay.placement, D, K, TM, dtype=torch.float32)
    assert lay32.msg_bytes == 4 * D
    check_rows(torch.zeros(3, D), lay32, "x")
    with pytest.raises(ConfigError, match=r"row dtype torch\.float64"):
        EpLayout(lay.placement, D, K, TM, dtype=torch.float64)
    # the NVSHMEM kernels move bf16 rows: another layout is refused at construction (before the
    # device is touched: the context only says cuda)
    ctx = SimpleNamespace(rank=1, world_size=2, device=torch.device("cuda"), timeout_s=5.0)
    with pytest.raises(ConfigError, match=r"EP backend nvshmem moves bf16 rows, this model computes in torch\.float32"):
        NvshmemComm.create(ctx, lay32)
    # the experts compute in their rows' dtype
    w = torch.zeros(len(lay.local_experts), 4, D)
    shard = ExpertShard(lay.local_experts, w, w, torch.zeros(len(lay.local_experts), D, 4))
    with pytest.raises(
        ConfigError, match=r"rank 1: expert weights are torch\.float32, the layout carries torch\.bfloat16"
    ):
        EpMoELayer(SimpleNamespace(layout=lay), shard)
    EpMoELayer(SimpleNamespace(layout=lay32), shard)
