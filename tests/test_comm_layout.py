"""The protocol arithmetic alone (single process): owner choice, slots, packing, FP8, placement."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerodram.runtime.comm import (
    EpLayout,
    ExpertPlacement,
    RouteInput,
    from_topology,
    packed_offsets,
    plan_send,
)
from zerodram.runtime.comm.layout import fp8_dequantize, fp8_quantize
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.moe import RouterConfig, route


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(0, 12), st.sampled_from([1, 2, 4]), st.integers(0, 2**31))
def test_slots_are_dense_and_in_token_order(W: int, T: int, K: int, seed: int) -> None:
    E = 8
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    idx = idx.to(torch.int64)
    placement = ExpertPlacement.contiguous(0, W, E)
    plan = plan_send(idx, placement)
    for e in range(E):
        t, k = torch.where(idx == e)
        assert plan.slot[t, k].tolist() == list(range(len(t)))  # 0, 1, 2, ... in token order
        assert set(plan.dst_rank[t, k].tolist()) <= {placement.expert_to_rank[e]}


def test_replicas_alternate_by_token() -> None:
    p = ExpertPlacement(0, 2, (0, 1), replicas=((1,), ()))
    plan = plan_send(torch.zeros(4, 1, dtype=torch.int64), p)
    assert plan.dst_rank.flatten().tolist() == [0, 1, 0, 1]
    assert plan.local_expert_idx.flatten().tolist() == [0, 0, 0, 0]  # expert 0 is local 0 on both
    assert plan.slot.flatten().tolist() == [0, 0, 1, 1]


def test_masked_choices_go_nowhere() -> None:
    plan = plan_send(torch.tensor([[0, -1], [-1, 1]]), ExpertPlacement.contiguous(0, 2, 2))
    assert plan.dst_rank.tolist() == [[0, -1], [-1, 1]]


def test_packed_offsets_are_expert_major() -> None:
    counts = torch.tensor([[1, 0, 2], [3, 1, 0]])  # [El=2, W=3]
    pair, ends = packed_offsets(counts)
    assert pair.tolist() == [[0, 1, 1], [3, 6, 7]]
    assert ends.tolist() == [3, 7]


def test_fp8_round_trip_is_within_e4m3_precision() -> None:
    x = torch.randn(5, 256) * torch.logspace(-3, 2, 256)
    q, scale = fp8_quantize(x)
    assert q.dtype == torch.float8_e4m3fn
    assert scale.shape == (5, 2)
    y = fp8_dequantize(q, scale, torch.float32)
    group_max = x.view(5, 2, 128).abs().amax(-1, keepdim=True)
    assert ((y - x).view(5, 2, 128).abs() <= group_max / 16 + 1e-12).all()  # 3 mantissa bits


def test_layout_sizes() -> None:
    lay = EpLayout(ExpertPlacement.contiguous(1, 4, 32), 7168, 8, 128, "fp8")
    assert lay.msg_bytes % 16 == 0
    assert lay.msg_bytes == 7168 + 224
    assert lay.recv_capacity == 8 * 4 * 128
    assert lay.local_experts == tuple(range(8, 16))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ring_peers": (1, 0)}, "itself first"),
        ({"expert_to_rank": (0, 5)}, "placed on rank 5"),
    ],
)
def test_placement_errors_name_both_sides(kwargs: dict, match: str) -> None:
    base = {"rank": 0, "world_size": 2, "expert_to_rank": (0, 1)}
    with pytest.raises(ConfigError, match=match):
        ExpertPlacement(**{**base, **kwargs})


def test_layout_rejects_what_the_wire_cannot_carry() -> None:
    p = ExpertPlacement.contiguous(0, 1, 4)
    with pytest.raises(ConfigError, match="fp8 wire needs hidden"):
        EpLayout(p, 200, 2, 4, "fp8")
    with pytest.raises(ConfigError, match="top_k 9"):
        EpLayout(p, 128, 9, 4)


def test_route_input_wants_exactly_one_routing() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        RouteInput()
    with pytest.raises(ConfigError, match="exactly one"):
        RouteInput(logits=torch.zeros(1, 2), gate_weight=torch.zeros(2, 2))


def test_router_renormalises_and_scores() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    idx, w = route(logits, RouterConfig(4, 2))
    assert idx.tolist() == [[3, 2]]
    assert torch.allclose(w.sum(-1), torch.ones(1))
    idx, w = route(logits, RouterConfig(4, 2, scoring="sigmoid", renormalize=False))
    assert torch.allclose(w, torch.sigmoid(torch.tensor([[3.0, 2.0]])))


class _FakeExperts:
    expert_to_rank = (0, 0, 1, 1)

    def owners(self, e: int) -> tuple[int, ...]:
        return (self.expert_to_rank[e], 1 - self.expert_to_rank[e]) if e == 0 else (self.expert_to_rank[e],)


class _FakeRing:
    def peers(self, rank: int) -> tuple[int, ...]:
        return (rank, 1 - rank)


class _FakeTopo:
    experts = _FakeExperts()
    ring = _FakeRing()


def test_from_topology_uses_only_the_documented_attributes() -> None:
    p = from_topology(_FakeTopo(), 1)
    assert p.rank == 1
    assert p.world_size == 2
    assert p.ring_peers == (1, 0)
    assert p.owners(0) == (0, 1)
    assert p.local_experts(1) == (0, 2, 3)


def test_one_phase_heap_does_not_grow_with_the_layers() -> None:
    """The engine's NVSHMEM session (one_phase) holds one phase for every layer's communicator;
    unpinned communicators take two phases each."""
    from zerodram.runtime.comm.nvshmem_comm import SymmetricLayout, heap_bytes

    lay = EpLayout(ExpertPlacement.contiguous(0, 8, 256), 7168, 8, 128)
    phase, slack = SymmetricLayout.of(lay).phase_bytes, 256 << 20
    assert 400 << 20 < phase < 500 << 20  # DeepSeek-V3-like, EP 8, 128 tokens a rank: ~462 MiB
    assert heap_bytes(lay, 58) == 58 * 2 * phase + slack
    assert heap_bytes(lay, 58, one_phase=True) == heap_bytes(lay, 1, one_phase=True) == phase + slack


def test_router_ties_go_to_the_lowest_expert_id_on_the_logits() -> None:
    """The fused router's rule: the K largest logits, ties to the lowest id, chosen on the logits
    (sigmoid scores saturate into ties the logits do not have)."""
    idx, w = route(torch.zeros(3, 8), RouterConfig(8, 2))
    assert idx.tolist() == [[0, 1]] * 3 and torch.allclose(w, torch.full((3, 2), 0.5))
    logits = torch.tensor([[17.0, 18.0, 19.0, 20.0, 0.0, 0.0, 0.0, 0.0]])
    idx, w = route(logits, RouterConfig(8, 2, scoring="sigmoid", renormalize=False))
    assert idx.tolist() == [[3, 2]] and torch.equal(w, torch.ones(1, 2))  # the scores all round to 1
