"""The multi-rank launcher itself: results come back, failures and hangs are reported, not hidden."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from multirank import RankFailedError, run_ranks

from zerodram.runtime.context import RankContext
from zerodram.runtime.errors import RankTimeoutError

pytestmark = pytest.mark.slow


def _sum_ranks(ctx: RankContext) -> tuple[int, int, float]:
    x = torch.tensor([float(ctx.rank)])
    dist.all_reduce(x)
    print("hello from the worker")
    return ctx.rank, ctx.world_size, x.item()


def _a_tensor(ctx: RankContext) -> torch.Tensor:
    return torch.arange(4.0) + ctx.rank  # the rank's process exits right after returning it


def _raise_on_rank_one(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(0.2)


def _hang_on_rank_zero(ctx: RankContext) -> None:
    if ctx.rank == 0:
        time.sleep(300)


def _skip_barrier_on_rank_one(ctx: RankContext) -> str:
    if ctx.rank == 1:
        time.sleep(4)  # never arrives in time
        return "skipped"
    try:
        ctx.barrier("test step")
    except RankTimeoutError as err:
        return str(err)
    return "no timeout"


def _leave_before_the_barrier_on_rank_one(ctx: RankContext) -> str:
    if ctx.rank == 1:
        return "left"  # its process group closes: rank 0's barrier fails at once, not at the limit
    try:
        ctx.barrier("test step")
    except RankTimeoutError as err:
        return str(err)
    return "no error"


def test_results_come_back_in_rank_order(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_ranks(_sum_ranks, 3) == [(0, 3, 3.0), (1, 3, 3.0), (2, 3, 3.0)]
    assert "[rank 2] hello from the worker" in capfd.readouterr().out


def test_tensors_come_back_by_value() -> None:
    """Not as handles to the rank's shared memory, which vanish when its process exits before the
    parent has opened them (a race a loaded CI machine lost)."""
    got = run_ranks(_a_tensor, 2)
    assert [t.tolist() for t in got] == [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]]
    assert not any(t.is_shared() for t in got)


def test_a_rank_exception_names_the_rank() -> None:
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 raised:\nValueError: rank one is unhappy"):
        run_ranks(_raise_on_rank_one, 2)


def test_a_hang_is_reported_with_the_waiting_ranks() -> None:
    # The budget covers spawning the ranks and importing torch, which takes over 10 s on a
    # loaded CPU machine: with less, rank 1 is still starting and gets reported as hanging too.
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=r"ranks \[0\] of 2 did not finish within 30s"):
        run_ranks(_hang_on_rank_zero, 2, timeout_s=30)
    assert time.monotonic() - t0 < 60


def test_a_missing_rank_times_out_a_barrier_by_name() -> None:
    out = run_ranks(_skip_barrier_on_rank_one, 2, rank_timeout_s=1.5)
    assert out[1] == "skipped"
    assert "rank 0/2: barrier 'test step' failed after " in out[0]
    assert "(limit 1.5s)" in out[0]
    assert "Rank 1 failed to pass" in out[0]  # gloo's monitored barrier names the missing rank


def test_a_peer_that_left_fails_a_barrier_early_and_the_message_says_when() -> None:
    out = run_ranks(_leave_before_the_barrier_on_rank_one, 2, rank_timeout_s=20)
    assert out[1] == "left"
    assert out[0].startswith("rank 0/2: barrier 'test step' failed after "), out[0]
    assert float(out[0].split("failed after ")[1].split("s ")[0]) < 10, out[0]
    assert "(limit 20s)" in out[0]
