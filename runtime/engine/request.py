"""Requests, their sampling parameters, validation, and what comes back.

A bad request (empty prompt, too long, token ids outside the vocabulary, invalid parameters, or a
KV need larger than the rank's whole partition) never reaches the scheduler: `validate` turns it
into a `RequestOutput` with `finish_reason == "error"` and a message, and the engine carries on.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from zerodram.runtime.errors import ZerodramError


class RequestError(ZerodramError):
    """A request the engine refuses; the message says why (it becomes the result's `error`)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_integral(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 (or anything below 1e-5) means greedy. top_p: nucleus mass in (0, 1]. seed: per-request generator seed
    (None: derived from the request id, so runs are reproducible). stop_token_ids: extra stop
    tokens; the model's EOS ids stop too unless `ignore_eos`.
    """

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def check(self) -> None:
        """Raise `RequestError` on an invalid parameter (bools are not numbers here)."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be integers, got {list(self.stop_token_ids)!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Parse JSON params (serve's input); unknown keys are an error."""
        known = {"max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "ignore_eos"}
        extra = set(d) - known
        if extra:
            raise RequestError(f"unknown sampling parameter(s) {sorted(extra)}; known: {sorted(known)}")
        kw = dict(d)
        if "stop_token_ids" in kw:
            if not isinstance(kw["stop_token_ids"], list | tuple):
                raise RequestError(f"stop_token_ids must be a list of integers, got {kw['stop_token_ids']!r}")
            kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
        if not isinstance(kw.get("ignore_eos", False), bool):
            raise RequestError(f"ignore_eos must be true or false, got {kw['ignore_eos']!r}")
        params = cls(**kw)
        params.check()
        return params


@dataclass
class Request:
    """One generation request as the scheduler tracks it (on the rank that owns it)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    finish_reason: str | None = None

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence holds in the KV cache once the current step is written."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


@dataclass
class RequestOutput:
    """The result of one request: tokens, text (when a tokenizer is present), why it stopped."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "error"
    text: str | None = None
    error: str | None = None
    rank: int = 0

    def to_json(self) -> dict[str, Any]:
        d = {
            "id": self.request_id,
            "finish_reason": self.finish_reason,
            "token_ids": self.token_ids,
            "num_prompt_tokens": len(self.prompt_ids),
            "rank": self.rank,
        }
        if self.text is not None:
            d["text"] = self.text
        if self.error is not None:
            d["error"] = self.error
        return d


@dataclass(frozen=True)
class TokenEvent:
    """One step's news about one request: a new token and/or its end (streamed to the caller)."""

    request_id: int
    token_id: int | None
    finish_reason: str | None = None
    error: str | None = None
    rank: int = 0


def validate(
    request_id: int,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    max_seq_tokens: int,
) -> Request:
    """A checked `Request`, or `RequestError` naming what is wrong.

    Args:
        max_model_len: positions the model supports (prompt + max_tokens must fit).
        max_seq_tokens: tokens the rank's whole KV partition can hold for one sequence.
    """
    params.check()
    if not prompt_ids:
        raise RequestError("empty prompt")
    # an integer of any kind (numpy's too), never a bool (docs/engine.md) nor a float; plain ints,
    # the common case, skip the ABC check (rank 0 validates while every rank waits)
    if not all(type(t) is int for t in prompt_ids):
        kind = next(((i, t) for i, t in enumerate(prompt_ids) if not _is_integral(t)), None)
        if kind is not None:
            raise RequestError(
                f"prompt token ids must be integers; item {kind[0]} is {kind[1]!r} ({type(kind[1]).__name__})"
            )
        prompt_ids = [int(t) for t in prompt_ids]
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} outside the vocabulary (size {vocab_size})")
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise RequestError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {total} "
            f"exceeds the model's {max_model_len} positions"
        )
    if total > max_seq_tokens:
        raise RequestError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {total} tokens "
            f"can never fit this rank's KV partition ({max_seq_tokens} tokens)"
        )
    return Request(request_id, list(prompt_ids), params)
