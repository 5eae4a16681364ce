"""The host-driven path's routing plan, vectorised: send order and counts on the device, receive
positions on the host from the exchanged counts.

Shape legend: T tokens, K top-k, E experts, W world size, Elm max local experts, El local experts,
P = W * Elm (dst, local expert) pairs, S rows sent, R rows received.

    planner = HostPlanner(placement, top_k, max_tokens_per_rank, device)    # tables built once
    send = planner.send(topk_idx)        # [T*K] send order + [P] send counts, no host sync
    ...counts exchange (the one host sync)...
    recv = planner.recv(recv_counts)     # host numpy: packed position of every arriving row

Same rules as `layout.plan_send` (the reference the tests compare with): owner
``owners(e)[t % len(owners(e))]``, and within one (dst, local expert) pair rows go in token order,
which is the slot order, so the receiver derives every row's slot from the counts alone and
nothing but the rows travels. Everything here is a fixed handful of tensor ops per call, whatever
T, E or K: no Python loop over tokens, experts or ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zerodram.runtime.comm.layout import ExpertPlacement


@dataclass(frozen=True)
class SendOrder:
    """Where this rank's rows go.

    Attributes:
        order: [T*K] int64 src_idx (t*K + k) sorted by (dst rank, local expert, token); the S
            routed entries come first, masked choices (topk_idx < 0) last.
        send_counts: [P + 1] int64 rows per (dst, local expert) pair, pair = dst * Elm + le; the
            last entry counts masked choices (never sent).
    """

    order: torch.Tensor
    send_counts: torch.Tensor


@dataclass(frozen=True)
class RecvOrder:
    """Where the rows that arrive (in (src rank, local expert, slot) order) go: host arrays.

    Attributes:
        recv_pos: [R] packed (expert-major) position of each arriving row.
        packed_src: [R] arrival index of each packed row (the inverse of recv_pos).
        recv_expert_offsets: [El] cumulative ends of each local expert's rows.
        recv_num_tokens_per_expert: [El] rows per local expert.
    """

    recv_pos: np.ndarray
    packed_src: np.ndarray
    recv_expert_offsets: np.ndarray
    recv_num_tokens_per_expert: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.recv_pos.shape[0])


class HostPlanner:
    """The routing plan of one layer's host-driven dispatch, with its tables built once.

    Args:
        placement: expert ownership (this rank's view).
        top_k: K.
        max_tokens: Tm, the most tokens one dispatch carries.
        device: where topk_idx lives (the send plan runs there).
    """

    def __init__(self, placement: ExpertPlacement, top_k: int, max_tokens: int, device: torch.device) -> None:
        W, Elm = placement.world_size, placement.max_local_experts
        self.world_size, self.max_local_experts = W, Elm
        self.num_local_experts = len(placement.local_experts(placement.rank))
        self.top_k, self.max_tokens = top_k, max_tokens
        self.num_pairs = W * Elm
        owner_rank, owner_local, num_owners = (t.to(torch.int64) for t in placement.owner_tables())
        pair = owner_rank * Elm + owner_local  # [E, R] pair id of each (expert, owner)
        # Row 0 answers topk_idx == -1 (looked up at index e + 1): the masked pair P sorts last and
        # lands in the extra counter, so a masked choice costs no branch.
        masked = torch.full((1, pair.shape[1]), self.num_pairs, dtype=torch.int64)
        self._pair = torch.cat([masked, pair]).to(device)  # [E + 1, R]
        self._pair0 = self._pair[:, 0].contiguous()  # [E + 1] the primary owner's pair
        self._replicated = placement.max_owners > 1
        if self._replicated:
            self._num_owners = torch.cat([torch.ones(1, dtype=torch.int64), num_owners]).to(device)  # [E + 1]
            self._token = torch.arange(max_tokens * top_k, device=device) // top_k  # [Tm*K] t of t*K+k
            self._max_owners = pair.shape[1]
        self._ones = torch.ones(max_tokens * top_k, dtype=torch.int64, device=device)

    def send(self, topk_idx: torch.Tensor, counts_out: torch.Tensor | None = None) -> SendOrder:
        """The send order and per-pair counts of topk_idx [T, K] (-1: no expert); no host sync.

        Args:
            counts_out: optional [P + 1] int64 buffer to count into (zeroed here).
        """
        e1 = topk_idx.reshape(-1).clamp(min=-1) + 1  # [T*K] expert + 1; 0 = masked
        n = e1.shape[0]
        if self._replicated:
            o = self._token[:n] % self._num_owners[e1]  # which owner serves this token
            key = self._pair.view(-1)[e1 * self._max_owners + o]  # [T*K]
        else:
            key = self._pair0[e1]  # [T*K]
        # stable: within a pair, token order (the slot order of the protocol)
        order = torch.argsort(key, stable=True)
        if counts_out is None:
            counts_out = torch.zeros(self.num_pairs + 1, dtype=torch.int64, device=key.device)
        else:
            counts_out.zero_()
        # scatter_add, not bincount: bincount sizes its output from the data (a host sync on GPU)
        counts_out.scatter_add_(0, key, self._ones[:n])
        return SendOrder(order, counts_out)

    def recv(self, recv_counts: np.ndarray) -> RecvOrder:
        """Packed positions from the counts received, on the host.

        Args:
            recv_counts: [W, Elm] rows from each source rank for each local expert.
        """
        W, El = self.world_size, self.num_local_experts
        c = np.ascontiguousarray(np.asarray(recv_counts, dtype=np.int64)[:, :El])  # [W, El] arrival segments
        arr_len = c.reshape(-1)  # arrival order: (src, le)
        arr_start = np.cumsum(arr_len) - arr_len
        pk_len = c.T.reshape(-1)  # packed order: (le, src)
        pk_start = np.cumsum(pk_len) - pk_len
        R = int(arr_len.sum())
        # a segment's rows keep their order on both sides: position = its start there + rank in it
        arr_to_pk = pk_start.reshape(El, W).T.reshape(-1) - arr_start  # [W*El] per arrival segment
        pk_to_arr = arr_start.reshape(W, El).T.reshape(-1) - pk_start  # [El*W] per packed segment
        ramp = np.arange(R, dtype=np.int64)
        num_per_expert = c.sum(0)  # [El]
        return RecvOrder(
            recv_pos=np.repeat(arr_to_pk, arr_len) + ramp,
            packed_src=np.repeat(pk_to_arr, pk_len) + ramp,
            recv_expert_offsets=np.cumsum(num_per_expert),
            recv_num_tokens_per_expert=num_per_expert,
        )
