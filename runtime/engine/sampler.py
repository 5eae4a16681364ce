"""Token sampling: greedy, temperature, top-p, each request with its own seeded generator.

Shape legend: N rows sampled this step, V vocab.

A request's generator is created once (seeded by `params.seed`, or by the request id when unset)
and advanced only by that request's draws, so its tokens do not depend on what else is batched
with it or on which rank it runs.
"""

from __future__ import annotations

import torch

from zerodram.runtime.engine.request import SamplingParams


def make_generator(params: SamplingParams, request_id: int, device: torch.device) -> torch.Generator | None:
    """The request's generator (None for greedy requests, which draw nothing)."""
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else 0x5EED + request_id
    return torch.Generator(device=device).manual_seed(seed)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of tokens whose mass reaches `top_p`; probs [V] -> [V]."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    drop = (cum - sorted_probs) >= top_p  # mass before this token already reaches top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum()


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of `logits` [N, V] (fp32) under each row's params and generator."""
    if logits.shape[0] == 0:
        return []
    greedy = logits.argmax(dim=-1).tolist()  # [N]
    out = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.temperature == 0 or gen is None:
            out.append(int(greedy[row]))
            continue
        probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)  # [V]
        probs = top_p_filter(probs, p.top_p)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
