"""The single-process reference MoE layer: what every expert-parallel run must reproduce.

Shape legend: T tokens, D hidden, E experts, K top-k, F expert FFN dim.

Plain torch, one expert at a time, every weight global. Also builds test weights from a seed and
slices the global experts into a rank's `ExpertShard`, so that tests and benchmarks on every rank
derive identical data from one shared seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodram.runtime.moe.experts import ExpertShard, SharedExpertWeights, swiglu
from zerodram.runtime.moe.router import RouterConfig, gate_logits, route


@dataclass(frozen=True)
class MoEWeights:
    """One MoE layer's global weights.

    Attributes:
        gate_weight: router projection [E, D].
        w_gate, w_up: [E, F, D]; w_down: [E, D, F].
        shared: the shared expert, or None.
    """

    gate_weight: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    shared: SharedExpertWeights | None = None

    @staticmethod
    def random(
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        seed: int,
        shared_ffn: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> MoEWeights:
        """Seeded weights scaled so activations stay O(1): same seed, same weights on every rank."""
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / fan_in**0.5).to(dtype=dtype, device=device)

        E, D, F_ = num_experts, hidden, ffn
        shared = None
        if shared_ffn:
            shared = SharedExpertWeights(
                rnd(shared_ffn, D, fan_in=D),
                rnd(shared_ffn, D, fan_in=D),
                rnd(D, shared_ffn, fan_in=shared_ffn),
            )
        return MoEWeights(
            gate_weight=rnd(E, D, fan_in=D),
            w_gate=rnd(E, F_, D, fan_in=D),
            w_up=rnd(E, F_, D, fan_in=D),
            w_down=rnd(E, D, F_, fan_in=F_),
            shared=shared,
        )

    def shard(self, expert_ids: tuple[int, ...]) -> ExpertShard:
        """The experts `expert_ids` (a rank's `local_experts`) as an `ExpertShard`."""
        idx = torch.tensor(expert_ids, dtype=torch.int64)
        return ExpertShard(
            tuple(expert_ids),
            self.w_gate[idx].contiguous(),
            self.w_up[idx].contiguous(),
            self.w_down[idx].contiguous(),
        )


def reference_experts(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, weights: MoEWeights
) -> torch.Tensor:
    """Routed experts only: out[t] = sum_k topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t]).

    Args:
        x: [T, D]; topk_idx: [T, K] (-1 skips); topk_weight: [T, K].

    Returns:
        [T, D] in x's dtype (sum in fp32, like the combine).
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_idx[topk_idx >= 0]).tolist():
        token_idx, choice_idx = torch.where(topk_idx == e)  # [n], [n]
        y = swiglu(x[token_idx], weights.w_gate[e], weights.w_up[e], weights.w_down[e])  # [n, D]
        out.index_add_(0, token_idx, y.float() * topk_weight[token_idx, choice_idx, None].float())
    return out.to(x.dtype)


def reference_moe(
    x: torch.Tensor, weights: MoEWeights, router: RouterConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole layer: route, routed experts, plus the shared expert.

    Args:
        x: [T, D].

    Returns:
        (out [T, D], topk_idx [T, K], topk_weight [T, K]).
    """
    topk_idx, topk_weight = route(gate_logits(x, weights.gate_weight), router)
    out = reference_experts(x, topk_idx, topk_weight, weights)
    if weights.shared is not None:
        out = out + weights.shared(x)
    return out, topk_idx, topk_weight
