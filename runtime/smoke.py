"""The multi-rank smoke job: proves a launch is wired end to end before anything heavier runs.

Every rank (1) joins an all-reduce whose result it can check, then (2) walks the topology's
dispatch ring: at step s it sends a row encoding (source rank, step) to the peer the ring names and
receives from the rank that targets it, checking the row. Rank 0 reports one line.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zerodram.runtime.context import RankContext
from zerodram.runtime.errors import ZerodramError


def ring_steps(ctx: RankContext) -> tuple[tuple[int, ...], ...]:
    """The ring schedule: the topology's, or the plain shift ring without one."""
    if ctx.topology is not None:
        return ctx.topology.ring.steps
    n = ctx.world_size
    return tuple(tuple((r + s) % n for r in range(n)) for s in range(n))


def run(ctx: RankContext, argv: list[str]) -> int:
    t0 = time.perf_counter()
    n, rank = ctx.world_size, ctx.rank
    x = torch.tensor([float(rank + 1)], device=ctx.device)
    dist.all_reduce(x)
    expected = n * (n + 1) / 2
    if x.item() != expected:
        raise ZerodramError(f"rank {rank}: all-reduce gave {x.item()}, expected {expected}")

    steps = ring_steps(ctx)
    for s, dst_of in enumerate(steps):
        dst = dst_of[rank]
        src = dst_of.index(rank)  # each step is a permutation: exactly one rank targets me
        send = torch.tensor([rank, s, rank * 1000 + s], dtype=torch.int64, device=ctx.device)
        recv = torch.empty_like(send)
        if dst == rank:
            recv.copy_(send)
        else:
            ops = [dist.P2POp(dist.isend, send, dst), dist.P2POp(dist.irecv, recv, src)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        got = recv.tolist()
        if got != [src, s, src * 1000 + s]:
            raise ZerodramError(f"rank {rank} ring step {s}: expected row from rank {src}, got {got}")
    ctx.barrier("smoke done")
    if rank == 0:
        name = ctx.topology.name if ctx.topology is not None else "ad-hoc"
        ms = (time.perf_counter() - t0) * 1e3
        print(
            f"smoke ok: {name}: {n} ranks on {ctx.device.type} ({ctx.backend}), all-reduce ok, "
            f"ring of {len(steps)} steps ok, {ms:.0f} ms"
        )
    return 0
