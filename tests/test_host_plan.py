"""The host path's vectorised planner against the protocol's reference (`plan_send`, `packed_offsets`),
in one process: every rank's send plan is built, the counts and rows are moved by hand, and each
receiver's packed rows must be exactly the reference's (expert-major, source-minor, slot order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zerodram.runtime.comm import ExpertPlacement, packed_offsets, plan_send
from zerodram.runtime.comm.host_plan import HostPlanner

TM = 16


def _routing(kind: str, T: int, E: int, K: int, g: torch.Generator) -> torch.Tensor:
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]  # [T, K] distinct experts per token
    if kind == "all_to_one":  # every token's first choice is expert E-1, the rest distinct others
        rest = torch.rand(T, E - 1, generator=g).argsort(1)[:, : K - 1]
        idx = torch.cat([torch.full((T, 1), E - 1, dtype=torch.int64), rest], 1)
    elif kind == "few_experts":  # most experts get nothing
        idx = torch.stack([torch.randperm(min(E, K + 1), generator=g)[:K] for _ in range(T)])
    elif kind == "masked":
        idx[torch.rand(T, K, generator=g) < 0.4] = -1
    return idx


def _placements(W: int, E: int, replicas: bool) -> list[ExpertPlacement]:
    out = []
    for r in range(W):
        base = ExpertPlacement.contiguous(r, W, E)
        if replicas and W > 1:
            reps = tuple(((base.expert_to_rank[e] + 1) % W,) if e % 3 == 0 else () for e in range(E))
            base = ExpertPlacement(r, W, base.expert_to_rank, reps, tuple((r - s) % W for s in range(W)))
        out.append(base)
    return out


def _check(W: int, E: int, K: int, tokens: list[int], kind: str, replicas: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    places = _placements(W, E, replicas)
    topks = [_routing(kind, T, E, K, g) for T in tokens]
    Elm = places[0].max_local_experts
    plans = [plan_send(topks[r], places[r]) for r in range(W)]  # the reference
    sends = []
    for r in range(W):
        s = HostPlanner(places[r], K, TM, torch.device("cpu")).send(topks[r])
        valid = int((topks[r] >= 0).sum())
        counts = s.send_counts[:-1].view(W, Elm)
        assert int(counts.sum()) == valid and int(s.send_counts[-1]) == topks[r].numel() - valid
        sent = s.order[:valid]  # [S] t*K + k
        ref = plans[r]
        key = [
            (
                int(ref.dst_rank.flatten()[i]),
                int(ref.local_expert_idx.flatten()[i]),
                int(ref.slot.flatten()[i]),
            )
            for i in sent.tolist()
        ]
        assert all(k[0] >= 0 for k in key), "a masked choice was sent"
        assert key == sorted(key) and len(set(key)) == len(key), f"rank {r}: not (dst, le, slot) order"
        sends.append((sent, counts))
    for d in range(W):
        El = len(places[d].local_experts(d))
        recv_counts = torch.stack([sends[s][1][d] for s in range(W)])  # [W(src), Elm]
        recv = HostPlanner(places[d], K, TM, torch.device("cpu")).recv(recv_counts.numpy())
        # arrival order: source by source, each source's rows for d in its send order
        arrival = []
        for s in range(W):
            sent, counts = sends[s]
            start = int(counts[:d].sum())
            arrival += [(s, i) for i in sent[start : start + int(counts[d].sum())].tolist()]
        packed = [arrival[i] for i in recv.packed_src.tolist()]
        want = []
        for le in range(El):
            for s in range(W):
                ref = plans[s]
                hits = torch.nonzero((ref.dst_rank == d) & (ref.local_expert_idx == le))
                rows = sorted((int(ref.slot[t, k]), int(t) * K + int(k)) for t, k in hits.tolist())
                want += [(s, i) for _, i in rows]
        assert packed == want, f"rank {d}: packed rows differ from the reference"
        assert np.array_equal(recv.packed_src[recv.recv_pos], np.arange(len(arrival)))  # inverses
        _, ends = packed_offsets(recv_counts[:, :El].t())
        assert recv.recv_expert_offsets.tolist() == ends.tolist()
        assert recv.recv_num_tokens_per_expert.tolist() == recv_counts[:, :El].sum(0).tolist()


@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("kind", ["uniform", "all_to_one", "few_experts", "masked"])
@pytest.mark.parametrize("replicas", [False, True])
def test_lean_planner_matches_the_reference(K: int, kind: str, replicas: bool) -> None:
    for seed, (W, E, tokens) in enumerate(
        [(1, 8, [TM]), (2, 16, [5, 0]), (4, 16, [TM, 3, 0, 9]), (3, 8, [0, 0, 0]), (4, 32, [1, 7, 16, 2])]
    ):
        _check(W, E, K, tokens, kind, replicas, seed=100 * K + seed)


def test_planner_on_zero_tokens_sends_nothing() -> None:
    p = ExpertPlacement.contiguous(0, 2, 4)
    s = HostPlanner(p, 2, TM, torch.device("cpu")).send(torch.zeros(0, 2, dtype=torch.int64))
    assert s.order.numel() == 0 and int(s.send_counts.sum()) == 0
    r = HostPlanner(p, 2, TM, torch.device("cpu")).recv(np.zeros((2, 2), dtype=np.int64))
    assert r.num_rows == 0 and r.recv_expert_offsets.tolist() == [0, 0]
