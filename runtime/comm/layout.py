"""The dispatch protocol's arithmetic: who owns an expert, where a (token, choice) lands, buffer sizes.

Shape legend: T tokens on this rank, Tm max tokens per rank, E experts, El local experts,
Elm max local experts over ranks, W world size, D hidden, K top-k, N received rows.

Both backends (NVSHMEM kernels and torch.distributed) follow these rules; the CUDA side mirrors
them in `kernels/cuda/moe_layout.cuh`:

    owner choice    (token t, choice k) routed to expert e goes to ``owners(e)[t % len(owners(e))]``
                    (the primary when e has no replicas); ``local_expert_idx`` is e's position in
                    that rank's ascending `local_experts`
    receive slab    ``recv_slab[local_expert_idx, src_rank, slot]``: each (expert, source rank)
                    pair owns Tm slots, enough for every token of the source (a token picks an
                    expert at most once), so no counts round trip is needed before sending
    slot            order of arrival within the pair (token order on the host path; atomic,
                    hence unspecified, on the GPU)
    src_idx         ``t * K + k``: travels with each row; the combine writes the expert output back
                    to row src_idx of the source's combine buffer, where router weights reduce it
    packed layout   expert-major: rows of local expert 0 from source 0, 1, ..., W-1, then expert 1;
                    ``recv_pair_offsets[le, src]`` is where a pair starts, ``recv_expert_offsets[le]``
                    the cumulative end of expert le (the ``offs`` of `torch._grouped_mm`)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.topology.placement import EP_WIRES

WIRE_FORMATS = EP_WIRES  # one list: a topology's experts.wire takes the same formats
FP8_GROUP = 128  # channels per FP8 scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what a layout's rows may be


@dataclass(frozen=True)
class ExpertPlacement:
    """Expert ownership (identical on every rank) and this rank's ring order.

    Attributes:
        rank, world_size: this rank and W.
        expert_to_rank: primary owner of each expert, ``[E]``.
        replicas: extra owners per expert, ``[E][*]``; ``()`` means none anywhere.
        ring_peers: the order this rank visits destinations, itself first (a permutation of
            0..W-1); ``()`` means rank order rotated to start at `rank`.

    Raises:
        ConfigError: an owner outside 0..W-1, or ring_peers not a permutation starting at rank.
    """

    rank: int
    world_size: int
    expert_to_rank: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...] = ()
    ring_peers: tuple[int, ...] = ()
    _local: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        W, E = self.world_size, len(self.expert_to_rank)
        if not 0 <= self.rank < W:
            raise ConfigError(f"rank {self.rank} outside world size {W}")
        if not self.replicas:
            object.__setattr__(self, "replicas", tuple(() for _ in range(E)))
        if len(self.replicas) != E:
            raise ConfigError(f"replicas list {len(self.replicas)} experts, expert_to_rank {E}")
        if not self.ring_peers:
            object.__setattr__(self, "ring_peers", tuple((self.rank + s) % W for s in range(W)))
        if sorted(self.ring_peers) != list(range(W)) or self.ring_peers[0] != self.rank:
            raise ConfigError(
                f"ring_peers {self.ring_peers} of rank {self.rank} must list all {W} ranks, itself first"
            )
        local: list[set[int]] = [set() for _ in range(W)]
        for e in range(E):
            for r in self.owners(e):
                if not 0 <= r < W:
                    raise ConfigError(f"expert {e} placed on rank {r}, world size is {W}")
                local[r].add(e)
        object.__setattr__(self, "_local", tuple(tuple(sorted(s)) for s in local))

    @classmethod
    def contiguous(cls, rank: int, world_size: int, num_experts: int) -> ExpertPlacement:
        """Rank r owns experts [r*E/W, (r+1)*E/W) (the first E % W ranks one more)."""
        base, extra = divmod(num_experts, world_size)
        owners = []
        for r in range(world_size):
            owners += [r] * (base + (r < extra))
        return cls(rank, world_size, tuple(owners))

    @property
    def num_experts(self) -> int:
        return len(self.expert_to_rank)

    def owners(self, expert_idx: int) -> tuple[int, ...]:
        """Ranks hosting `expert_idx`, primary first."""
        return (self.expert_to_rank[expert_idx], *self.replicas[expert_idx])

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Experts hosted on `rank` (primaries and replicas), ascending: local index order."""
        return self._local[rank]

    @property
    def max_local_experts(self) -> int:
        return max(len(e) for e in self._local)

    @property
    def max_owners(self) -> int:
        return max(len(r) for r in self.replicas) + 1

    def owner_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(owner_rank [E, R], owner_local_idx [E, R], num_owners [E]) int32, R = max owners."""
        E, R = self.num_experts, self.max_owners
        rank = torch.zeros(E, R, dtype=torch.int32)
        local = torch.zeros(E, R, dtype=torch.int32)
        num = torch.zeros(E, dtype=torch.int32)
        for e in range(E):
            owners = self.owners(e)
            num[e] = len(owners)
            for o, r in enumerate(owners):
                rank[e, o] = r
                local[e, o] = self._local[r].index(e)
        return rank, local, num


def from_topology(topo: Any, rank: int) -> ExpertPlacement:
    """Adapter from `zerodram.runtime.topology.Topology` (duck-typed: experts.expert_to_rank,
    experts.owners(e), ring.peers(rank)) to the placement this package consumes."""
    e2r = tuple(topo.experts.expert_to_rank)
    replicas = tuple(tuple(topo.experts.owners(e))[1:] for e in range(len(e2r)))
    return ExpertPlacement(
        rank=rank,
        world_size=len(topo.ring.peers(rank)),
        expert_to_rank=e2r,
        replicas=replicas,
        ring_peers=tuple(topo.ring.peers(rank)),
    )


@dataclass(frozen=True)
class EpLayout:
    """Sizes of one MoE layer's dispatch: fixed at construction, so buffers are worst-case sized.

    Attributes:
        placement: ownership and ring order.
        hidden: D (a multiple of 128 for fp8, of 8 for bf16).
        top_k: K.
        max_tokens_per_rank: Tm, the most tokens any rank passes to one dispatch.
        wire: "bf16" (rows as they are, in `dtype`: bf16 on the NVSHMEM path; the host path also
            carries fp16 / fp32 models' rows) or "fp8" (e4m3 values plus one fp32 scale per 128
            channels).
        dtype: the rows' dtype: dispatch's x, combine's expert outputs and its result (the
            model's compute dtype). Every rank builds the same layout, so a rank's rows checked
            against its own layout (`base.check_rows`) have the size its peers expect: no
            collective needed to agree on it.

    Raises:
        ConfigError: an unknown wire format or row dtype, or a hidden size the format cannot carry.
    """

    placement: ExpertPlacement
    hidden: int
    top_k: int
    max_tokens_per_rank: int
    wire: str = "bf16"
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.wire not in WIRE_FORMATS:
            raise ConfigError(f"wire format {self.wire!r}; expected one of {WIRE_FORMATS}")
        if self.dtype not in ROW_DTYPES:
            raise ConfigError(f"row dtype {self.dtype}; expected one of {', '.join(map(str, ROW_DTYPES))}")
        if self.wire == "fp8" and self.hidden % FP8_GROUP:
            raise ConfigError(f"fp8 wire needs hidden % {FP8_GROUP} == 0, got hidden {self.hidden}")
        if self.hidden % 8:
            raise ConfigError(f"hidden {self.hidden} must be a multiple of 8 (16-byte rows)")
        if not 1 <= self.top_k <= min(8, self.placement.num_experts):
            raise ConfigError(f"top_k {self.top_k} outside 1..min(8, E={self.placement.num_experts})")
        if self.max_tokens_per_rank < 1:
            raise ConfigError(f"max_tokens_per_rank {self.max_tokens_per_rank} must be >= 1")

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.placement.local_experts(self.rank)

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    @property
    def msg_bytes(self) -> int:
        """Bytes of one row on the wire (16-byte multiple)."""
        if self.wire == "bf16":
            return self.hidden * self.dtype.itemsize
        return self.hidden + 4 * (self.hidden // FP8_GROUP) + (-(4 * (self.hidden // FP8_GROUP)) % 16)

    @property
    def recv_capacity(self) -> int:
        """Rows of the receive slab (and of the packed output on the GPU): Elm * W * Tm."""
        return self.placement.max_local_experts * self.world_size * self.max_tokens_per_rank


# -- the routing half of the protocol, in plain torch (host path and tests) ------------------------


@dataclass(frozen=True)
class SendPlan:
    """Where each (token, choice) goes. All tensors [T, K] int64; masked (topk_idx < 0) entries
    have dst_rank == -1."""

    dst_rank: torch.Tensor
    local_expert_idx: torch.Tensor
    slot: torch.Tensor


def plan_send(topk_idx: torch.Tensor, placement: ExpertPlacement) -> SendPlan:
    """Apply the owner-choice rule and number the slots in token order.

    Args:
        topk_idx: [T, K] global expert ids (-1: no expert).
    """
    T, K = topk_idx.shape
    owner_rank, owner_local, num_owners = (
        t.to(topk_idx.device, torch.int64) for t in placement.owner_tables()
    )
    valid = topk_idx >= 0  # [T, K]
    e = topk_idx.clamp(min=0)
    token = torch.arange(T, device=topk_idx.device).unsqueeze(1).expand(T, K)
    o = token % num_owners[e]  # [T, K] which owner serves this token
    dst = torch.where(valid, owner_rank[e, o], -1)
    le = torch.where(valid, owner_local[e, o], -1)
    # slot = occurrences of the same (dst, le) earlier in row-major (token, choice) order
    key = (dst * placement.max_local_experts + le).flatten()
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    group_start = torch.cummax(torch.where(first, torch.arange(key.numel(), device=key.device), 0), 0).values
    slot = torch.empty_like(key)
    slot[order] = torch.arange(key.numel(), device=key.device) - group_start
    return SendPlan(dst, le, torch.where(valid, slot.view(T, K), -1))


def packed_offsets(recv_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed layout from per-pair counts.

    Args:
        recv_counts: [El, W] rows received per (local expert, source rank).

    Returns:
        (recv_pair_offsets [El, W] start of each pair, recv_expert_offsets [El] cumulative ends),
        both int32.
    """
    flat = recv_counts.flatten().to(torch.int64)
    ends = torch.cumsum(flat, 0)
    starts = (ends - flat).view(recv_counts.shape)
    expert_ends = recv_counts.to(torch.int64).sum(1).cumsum(0)
    return starts.to(torch.int32), expert_ends.to(torch.int32)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (values [N, D] float8_e4m3fn, scales [N, D/128] fp32); scale = amax / 448."""
    N, D = x.shape
    g = x.float().view(N, D // FP8_GROUP, FP8_GROUP)
    scale = g.abs().amax(-1).clamp(min=1e-10) / FP8_MAX  # [N, D/128]
    q = (g / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(N, D)
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `fp8_quantize` -> [N, D] in `dtype`."""
    N, D = q.shape
    return (q.float().view(N, D // FP8_GROUP, FP8_GROUP) * scale.unsqueeze(-1)).view(N, D).to(dtype)
