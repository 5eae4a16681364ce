"""The protocol arithmetic alone (single process): owner choice, slots, packing, FP8, placement."""

from __future__ import annotations

import math

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
from zerodram.runtime.moe.router import SCORINGS


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


NAN, INF = float("nan"), float("inf")


def test_router_all_nan_row_takes_the_lowest_ids() -> None:
    """Every comparison with NaN is false: the kernel's argmax once found no expert for such a row
    (an index of INT_MAX into shared memory). NaN now ranks below -inf, NaNs tied by lowest id."""
    for scoring in SCORINGS:
        idx, w = route(torch.full((2, 8), NAN), RouterConfig(8, 3, scoring=scoring))
        assert idx.tolist() == [[0, 1, 2], [0, 1, 2]]
        assert w.isnan().all()  # the engine's non-finite checks end the request, downstream


def test_router_nan_ranks_below_every_number_and_minus_inf() -> None:
    logits = torch.tensor(
        [
            [NAN, 0.5, NAN, -INF, NAN, 2.0, -1.0, NAN],  # K > the 4 numbers: NaNs come last
            [NAN, 0.5, NAN, 3.0, NAN, 2.0, -1.0, 1.0],  # enough numbers: no NaN is chosen
        ]
    )
    idx, w = route(logits, RouterConfig(8, 6, scoring="sigmoid", renormalize=False))
    assert idx.tolist() == [[5, 1, 6, 3, 0, 2], [3, 5, 7, 1, 6, 0]]
    # sigmoid without renormalisation: only a chosen NaN's own weight is NaN
    assert torch.equal(w.isnan(), torch.tensor([[False] * 4 + [True] * 2, [False] * 5 + [True]]))
    torch.testing.assert_close(w[0, :4], torch.sigmoid(torch.tensor([2.0, 0.5, -1.0, -INF])))
    idx, w = route(logits, RouterConfig(8, 4, scoring="sigmoid"))
    assert idx.tolist() == [[5, 1, 6, 3], [3, 5, 7, 1]]
    assert w.isfinite().all() and torch.allclose(w.sum(-1), torch.ones(2))
    idx, w = route(logits, RouterConfig(8, 4))
    assert idx.tolist() == [[5, 1, 6, 3], [3, 5, 7, 1]] and w.isnan().all()  # softmax: any NaN, all NaN


def test_router_minus_inf_rows_choose_each_expert_once() -> None:
    """The kernel marked a chosen expert -inf, which tied with a real -inf and was chosen again."""
    logits = torch.tensor([[-INF, -INF, 1.0, -INF], [-INF] * 4])
    idx, w = route(logits, RouterConfig(4, 3, scoring="sigmoid"))
    assert idx.tolist() == [[2, 0, 1], [0, 1, 2]]
    assert torch.equal(w, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_router_signed_zeros_tie() -> None:
    idx, _ = route(torch.tensor([[-1.0, -0.0, 0.0, -0.0]]), RouterConfig(4, 3))
    assert idx.tolist() == [[1, 2, 3]]


def test_router_sigmoid_renormalisation_of_underflowed_scores_is_zero_not_nan() -> None:
    """sigmoid(-1000) is 0 in fp32: the sum of the chosen scores is 0, and 0 / 0 was NaN."""
    logits = torch.stack([-1000.0 - torch.arange(8.0), torch.arange(8.0)])
    idx, w = route(logits, RouterConfig(8, 4, scoring="sigmoid"))
    assert idx.tolist() == [[0, 1, 2, 3], [7, 6, 5, 4]]
    assert torch.equal(w[0], torch.zeros(4))
    torch.testing.assert_close(
        w[1], torch.sigmoid(logits[1, [7, 6, 5, 4]]) / torch.sigmoid(logits[1, 4:]).sum()
    )


_SPECIAL = [NAN, -NAN, INF, -INF, 0.0, -0.0, 1e-45, -1e-45, 1.0, -1.0, 3.0e38, -3.0e38]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(_SPECIAL), st.floats(width=32)), min_size=1, max_size=40), st.data()
)
def test_router_choice_is_the_documented_order(row: list[float], data: st.DataObject) -> None:
    """Against the rule written out in Python: numbers descending (-0 == +0), then NaNs; ties by id."""
    logits = torch.tensor([row])  # [1, E]
    row = logits[0].tolist()  # as fp32 holds them
    K = data.draw(st.integers(1, min(8, len(row))))
    idx, _ = route(logits, RouterConfig(len(row), K, scoring="sigmoid"))
    want = sorted(
        range(len(row)), key=lambda e: (math.isnan(row[e]), 0.0 if math.isnan(row[e]) else -row[e], e)
    )
    assert idx[0].tolist() == want[:K]
