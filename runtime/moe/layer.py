"""The expert-parallel MoE layer: route -> dispatch -> grouped SwiGLU experts -> combine (+ shared).

Shape legend: T tokens on this rank, D hidden, E experts, K top-k, N packed rows.

    layer = EpMoELayer.create(ctx, shard, num_experts=E, top_k=K, max_tokens_per_rank=Tm)
    y = layer(x, topk_idx, topk_weight)      # routed experts only: the model's ExpertParallel call
    y = layer.forward(x)                     # fused router (gate weight) + experts + shared expert

Collective: every rank calls it for every MoE layer, every step, even with T == 0.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodram.runtime.comm import Communicator, EpLayout, ExpertPlacement, create_communicator
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.moe.experts import ExpertShard, ExpertsPath, SharedExpertWeights, grouped_swiglu
from zerodram.runtime.moe.router import RouterConfig


class EpMoELayer:
    """One MoE layer over expert parallelism.

    Args:
        comm: the layer's communicator (its layout names this rank's local experts).
        experts: this rank's shard; ``experts.expert_ids`` must equal the layout's local experts.
        gate_weight: router projection [E, D], for `forward` (None: only `__call__` with topk).
        shared: shared expert added by `forward`, or None.
        experts_path: force the experts' path (None: chosen per step by size, see `grouped_swiglu`).

    Raises:
        ConfigError: the shard's experts differ from the placement's, or hidden sizes or dtypes
            differ (the experts compute in their rows' dtype, the layout's).
    """

    def __init__(
        self,
        comm: Communicator,
        experts: ExpertShard,
        *,
        gate_weight: torch.Tensor | None = None,
        shared: SharedExpertWeights | None = None,
        experts_path: ExpertsPath | None = None,
    ) -> None:
        lay = comm.layout
        if tuple(experts.expert_ids) != lay.local_experts:
            raise ConfigError(
                f"rank {lay.rank} holds experts {list(experts.expert_ids)}, "
                f"placement gives it {list(lay.local_experts)}"
            )
        if experts.num_local_experts and experts.w_gate.shape[2] != lay.hidden:
            raise ConfigError(f"expert hidden {experts.w_gate.shape[2]}, layout hidden {lay.hidden}")
        if experts.w_gate.dtype != lay.dtype:
            raise ConfigError(
                f"rank {lay.rank}: expert weights are {experts.w_gate.dtype}, the layout carries {lay.dtype} rows"
            )
        self.comm = comm
        self.experts = experts
        self.gate_weight = gate_weight
        self.shared = shared
        self.experts_path = experts_path

    @classmethod
    def create(
        cls,
        ctx: Any,
        experts: Any,
        *,
        num_experts: int,
        top_k: int,
        max_tokens_per_rank: int,
        placement: ExpertPlacement | None = None,
        router: RouterConfig | None = None,
        gate_weight: torch.Tensor | None = None,
        shared: SharedExpertWeights | None = None,
        wire: str = "bf16",
        dtype: torch.dtype | None = None,
        backend: str | None = None,
        session: Any = None,
    ) -> EpMoELayer:
        """Build layout, communicator and layer for this rank.

        Args:
            ctx: the `RankContext`.
            experts: an `ExpertShard`, or anything with expert_ids / w_gate / w_up / w_down (the
                model's ExpertWeights).
            placement: default: contiguous blocks of experts, rank order ring.
            router: default: softmax top-k with renormalisation.
            dtype: the rows' dtype, the model's (default: the experts' weights').
            wire, backend, session: see `EpLayout` and `create_communicator`.
        """
        placement = placement or ExpertPlacement.contiguous(ctx.rank, ctx.world_size, num_experts)
        # w_gate is [El, F, D] even for a rank that holds no expert (El = 0, when W > E)
        hidden = int(experts.w_gate.shape[2])
        dtype = dtype or experts.w_gate.dtype
        layout = EpLayout(placement, hidden, top_k, max_tokens_per_rank, wire, dtype)
        router = router or RouterConfig(num_experts, top_k)
        shard = (
            experts
            if isinstance(experts, ExpertShard)
            else ExpertShard(tuple(experts.expert_ids), experts.w_gate, experts.w_up, experts.w_down)
        )
        comm = create_communicator(ctx, layout, router, backend, session)
        return cls(comm, shard, gate_weight=gate_weight, shared=shared)

    @property
    def expert_load(self) -> torch.Tensor:
        """[El] int64 running rows per local expert (device tensor; read it off the hot path)."""
        return self.comm.expert_load

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Routed experts for precomputed routing: x [T, D], topk_idx/topk_weight [T, K] -> [T, D]."""
        out = self.comm.dispatch(x, topk_idx=topk_idx, topk_weight=topk_weight)
        return self._experts_and_combine(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer with the fused router: x [T, D] -> [T, D] (routed + shared expert).

        Raises:
            ConfigError: the layer was built without a gate weight.
        """
        if self.gate_weight is None:
            raise ConfigError("EpMoELayer.forward needs gate_weight; call layer(x, topk_idx, topk_weight)")
        y = self._experts_and_combine(self.comm.dispatch(x, gate_weight=self.gate_weight))
        if self.shared is not None:
            y = y + self.shared(x)  # overlaps nothing yet: a later step runs it during the dispatch
        return y

    def _experts_and_combine(self, out: Any) -> torch.Tensor:
        y_packed = grouped_swiglu(
            out.recv_x, out.recv_expert_offsets, self.experts, self.experts_path, sent_rows=out.topk_idx.numel()
        )  # [N, D]
        return self.comm.combine(y_packed, out)

    def close(self) -> None:
        """Close the communicator (idempotent)."""
        self.comm.close()
