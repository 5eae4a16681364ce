"""An MoE layer's experts when all of them are on this rank (no communication): the per-expert loop
(`LocalExperts`), its capturable twins (`RoutedLocalExperts`, routed on the device;
`DenseLocalExperts`, every expert on every row), chosen by `ep.capturable_ep`.

Shape legend: T tokens, D hidden, K top-k, El experts on this rank.

    experts(x [T, D], topk_idx [T, K], topk_weight [T, K]) -> y [T, D]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerodram.runtime.model.moe import ExpertWeights, swiglu
from zerodram.runtime.model.timing import NULL_TIMER, PhaseTimer

if TYPE_CHECKING:
    from zerodram.runtime.moe.experts import ExpertsPath


class LocalExperts:
    """All experts on this rank: no communication. Decode-sized calls (at most
    KERNEL_ROWS_PER_EXPERT choices per local expert) go through `RoutedLocalExperts` where the
    decode expert kernel takes the weights (CUDA, bf16): the path a captured step runs too. The
    rest, and every call elsewhere, through `ExpertWeights.forward` (one matmul per expert)."""

    def __init__(self, experts: ExpertWeights, timer: PhaseTimer = NULL_TIMER, every_token: bool = False) -> None:
        from zerodram.runtime.moe.experts import kernel_applies

        self.experts, self.timer, self.every_token = experts, timer, every_token
        routed = RoutedLocalExperts(experts, every_token=every_token) if experts.expert_ids else None
        self.routed = routed if routed is not None and kernel_applies(routed.shard) else None

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        from zerodram.runtime.moe.experts import decode_sized

        with self.timer.phase("experts"):
            if self.routed is not None and decode_sized(topk_idx.numel(), len(self.experts.expert_ids)):
                return self.routed(x, topk_idx, topk_weight)
            return self.experts.forward(x, topk_idx, topk_weight)


class DenseLocalExperts:
    """All experts on this rank with static shapes and no host sync (what a CUDA graph can
    capture): every local expert runs on every token, weighted by its combine weight (zero where
    the token did not pick it). El / K times the FLOPs of `LocalExperts`, and every expert's
    weights are read each call: meant for one rank's decode steps, where the batch is small.
    """

    def __init__(self, experts: ExpertWeights) -> None:
        self.experts = experts
        # made here, not per call: a host-to-device copy cannot run inside a capture
        self.ids = torch.tensor(experts.expert_ids, device=experts.w_gate.device)  # [El]

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_idx [T, K] global expert ids, topk_weight [T, K] -> [T, D]."""
        e = self.experts
        picked = topk_idx[:, :, None] == self.ids  # [T, K, El]
        combine = (picked * topk_weight[:, :, None]).sum(1).to(x.dtype)  # [T, El]
        out = torch.zeros_like(x)
        for local_idx in range(len(e.expert_ids)):
            y = swiglu(x, e.w_gate[local_idx], e.w_up[local_idx], e.w_down[local_idx])
            out += y * combine[:, local_idx, None]
        return out


class RoutedLocalExperts:
    """All experts on this rank, routed on the device: the T * K choices packed expert-major (a
    stable sort), runtime/moe's SwiGLU over the packed rows, then each token's weighted sum of its K
    rows. The path is runtime/moe's choice by the step's size (the decode expert kernel, which
    reads only the experts routed to, for decode-sized steps; `torch._grouped_mm` for bulk ones):
    static shapes and no host sync on a GPU, what a CUDA graph captures for a real MoE. `path`
    forces one (e.g. `loop` for CPU tests). Expert id -1 ("no expert") and other ranks' experts
    contribute nothing.

    every_token: the router sends every token to every expert with weight 1 and all of them are
    here (a dense FFN cut into slices, `dense_slices`, on one rank). The choices then carry nothing:
    the rows go to the experts as they are, without the sort, count and scatter (about 20 small
    kernels a layer at decode), and the experts' outputs are summed in expert order, as the general
    path sums a token's K rows.
    """

    def __init__(self, experts: ExpertWeights, path: ExpertsPath | None = None, every_token: bool = False) -> None:
        from zerodram.runtime.moe.experts import ExpertShard

        self.experts, self.path, self.every_token = experts, path, every_token
        self.shard = ExpertShard(experts.expert_ids, experts.w_gate, experts.w_up, experts.w_down)
        dev, El = experts.w_gate.device, len(experts.expert_ids)
        # global expert id -> local index, El for "not on this rank" (made here: no copies in a capture)
        self.local_of = torch.full(
            (max(experts.expert_ids, default=0) + 2,), El, dtype=torch.int64, device=dev
        )
        self.local_of[torch.tensor(experts.expert_ids, dtype=torch.int64, device=dev)] = torch.arange(
            El, device=dev
        )
        self.unit_ends = torch.arange(1, El + 1, dtype=torch.int32, device=dev)  # [El]: T * this = ends

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_idx [T, K] global expert ids (-1: none), topk_weight [T, K] -> [T, D]."""
        from zerodram.runtime.moe.experts import grouped_swiglu

        T, K = topk_idx.shape
        El = len(self.experts.expert_ids)
        if self.every_token:  # expert e's rows are all T tokens, in order: [El * T, D] expert-major
            rows = x if El == 1 else x.repeat(El, 1)
            ys = grouped_swiglu(rows, self.unit_ends * T, self.shard, self.path, sent_rows=T * K)
            return ys if El == 1 else ys.view(El, T, x.shape[1]).float().sum(0).to(x.dtype)
        ids = topk_idx.flatten()  # [T * K]
        local = torch.where(ids >= 0, self.local_of[ids.clamp(0, self.local_of.shape[0] - 1)], El)
        order = torch.argsort(local, stable=True)  # packed row -> choice (expert-major)
        counts = torch.zeros(El + 1, dtype=torch.int64, device=x.device).scatter_add_(
            0, local, torch.ones_like(local)
        )
        ends = counts[:El].cumsum(0).to(torch.int32)  # [El]
        ys = grouped_swiglu(x[order // K], ends, self.shard, self.path, sent_rows=T * K)  # [T * K, D] packed
        y = torch.empty_like(ys).index_copy_(0, order, ys)  # [T * K, D] per choice
        here = local < El
        w = torch.where(here, topk_weight.flatten(), 0.0)  # no expert / another rank's: weight 0
        y = torch.where(here[:, None], y, 0.0)  # and their rows are unspecified (maybe NaN)
        return (y.view(T, K, x.shape[1]).float() * w.view(T, K, 1).float()).sum(1).to(x.dtype)
