"""MoE pieces of a decoder layer: router, SwiGLU experts, shared expert.

Shape legend: T tokens, D hidden, E experts (global), El local experts, K top-k, F expert FFN dim.

Router kinds:
    softmax_topk   softmax over E in fp32, top-K, optionally renormalised over the K (Mixtral
                   always; Qwen-MoE when `norm_topk_prob`), cast back to the compute dtype
    dense_slices   a dense FFN cut into E slices: every token to all E experts with weight 1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerodram.runtime.model.config import ModelConfig


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); x [T, D], w_gate/w_up [F, D], w_down [D, F] -> [T, D]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


@dataclass
class ExpertWeights:
    """The SwiGLU experts one rank hosts for one layer.

    expert_ids: global expert index of each local expert (ascending), length El.
    w_gate, w_up: [El, F, D]; w_down: [El, D, F].
    """

    expert_ids: tuple[int, ...]
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Weighted sum of this shard's experts for every (token, choice) routed to one of them.

        x [T, D], topk_idx [T, K] global expert ids, topk_weight [T, K] -> partial out [T, D]
        (tokens routed only to other ranks' experts get zeros).
        """
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        for local_idx, expert_id in enumerate(self.expert_ids):
            token_idx, choice_idx = torch.where(topk_idx == expert_id)  # [n], [n]
            if token_idx.numel() == 0:
                continue
            y = swiglu(x[token_idx], self.w_gate[local_idx], self.w_up[local_idx], self.w_down[local_idx])
            # a token picks an expert at most once, so token_idx has no repeats: a plain indexed
            # add is exact (and, unlike index_add_, cheap on a crowded multi-threaded CPU)
            out[token_idx] += y * topk_weight[token_idx, choice_idx, None]
        return out


@dataclass
class SharedExpert:
    """Qwen2-MoE / DeepSeek shared expert: SwiGLU on every token, optionally scaled by sigmoid(x @ g)."""

    w_gate: torch.Tensor  # [Fs, D]
    w_up: torch.Tensor  # [Fs, D]
    w_down: torch.Tensor  # [D, Fs]
    sigmoid_gate: torch.Tensor | None  # [1, D]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = swiglu(x, self.w_gate, self.w_up, self.w_down)
        if self.sigmoid_gate is not None:
            y = torch.sigmoid(F.linear(x, self.sigmoid_gate)) * y
        return y


class Router:
    """Picks K experts per token and their weights.

    Args:
        config: the model config (router kind, E, K, renormalisation).
        weight: the gate projection [E, D] (None for dense slices).
    """

    def __init__(self, config: ModelConfig, weight: torch.Tensor | None) -> None:
        self.kind = config.router_kind
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_idx [T, K] int64, topk_weight [T, K] in x's dtype."""
        T = x.shape[0]
        if self.kind == "dense_slices":
            idx = torch.arange(self.num_experts, device=x.device).expand(T, -1)
            return idx, torch.ones(T, self.num_experts, dtype=x.dtype, device=x.device)
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weight, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.renormalize:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return idx, weight.to(x.dtype)
