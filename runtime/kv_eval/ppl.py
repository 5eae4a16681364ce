"""Teacher-forced perplexity over consecutive windows of a token stream."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv_eval.hook import CodecSession


@dataclass(frozen=True)
class PplResult:
    """nll: summed negative log-likelihood (nats) over `num_scored` predicted tokens."""

    nll: float
    num_scored: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / max(self.num_scored, 1))


def windows(ids: torch.Tensor, ctx: int, num_windows: int) -> list[torch.Tensor]:
    """The first `num_windows` consecutive windows of `ctx` tokens of ids [N]. # each [1, ctx]

    Raises:
        ConfigError: the text is too short.
    """
    if ids.numel() < ctx * num_windows:
        raise ConfigError(
            f"text has {ids.numel()} tokens, {num_windows} windows of {ctx} need {ctx * num_windows}"
        )
    return [ids[w * ctx : (w + 1) * ctx][None] for w in range(num_windows)]


def perplexity(session: CodecSession, wins: list[torch.Tensor]) -> PplResult:
    """Sum of NLL of tokens 1..ctx-1 of every window, each window a fresh sequence at position 0."""
    nll, n = 0.0, 0
    for x in wins:
        logits = session.forward(x).logits[0].float()  # [T, V]
        lp = torch.log_softmax(logits[:-1], -1)
        nll -= float(lp.gather(1, x[0, 1:, None]).sum())
        n += x.shape[1] - 1
    return PplResult(nll=nll, num_scored=n)
