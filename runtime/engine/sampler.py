"""Token sampling: greedy, temperature, top-p, each request with its own seeded generator.

Shape legend: N rows sampled this step, V vocab.

A request's generator is created once (seeded by `params.seed`, or by the request id when unset)
and advanced only by that request's draws, so its tokens do not depend on what else is batched
with it or on which rank it runs.
"""

from __future__ import annotations

import torch

from zerodram.runtime.engine.request import SamplingParams

# Temperatures below this sample greedily: the distribution is argmax's to within fp32 rounding,
# and 1 / T would overflow fp32 for the tiniest (torch turns a T below ~1e-45 into 0).
GREEDY_BELOW = 1e-5


def make_generator(params: SamplingParams, request_id: int, device: torch.device) -> torch.Generator | None:
    """The request's generator (None for greedy requests, which draw nothing)."""
    if params.temperature < GREEDY_BELOW:
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
) -> list[int | None]:
    """One token per row of `logits` [N, V] (fp32) under each row's params and generator; None for
    a row with a NaN or +inf logit, or with every logit -inf (no token can be drawn from it: the
    caller fails that request). -inf alone masks a token.

    Temperatures below `GREEDY_BELOW` are greedy; others scale the logits after their max is
    subtracted, so no finite logit overflows to inf (and inf - inf to NaN) on the way.
    """
    if logits.shape[0] == 0:
        return []
    greedy, top = logits.argmax(dim=-1), logits.amax(dim=-1)  # [N]: argmax as transformers' greedy
    # -inf is a masked token; NaN, +inf or nothing above -inf leave nothing to draw from
    ok = ~(torch.isnan(logits).any(dim=-1) | torch.isposinf(top) | torch.isneginf(top))  # [N]
    greedy_ids, ok = greedy.tolist(), ok.tolist()
    out: list[int | None] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not ok[row]:
            out.append(None)
        elif p.temperature < GREEDY_BELOW or gen is None:
            out.append(int(greedy_ids[row]))
        else:
            z = (logits[row].float() - top[row].float()) / p.temperature  # [V], <= 0, max exactly 0
            probs = top_p_filter(torch.softmax(z, dim=-1), p.top_p)
            out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
