"""Errors raised by the KV cache: capacity (so the engine can queue or reject) and bad input."""

from __future__ import annotations

from zerodram.runtime.errors import ZerodramError


class KVCapacityError(ZerodramError):
    """The page pool (or the per-sequence slots) is exhausted.

    Raised before anything is written, so the cache is unchanged and the engine may queue the
    request, preempt another sequence or reject it.
    """

    exit_code = 4


class KVInputError(ZerodramError):
    """A tensor handed to the cache or the quantizer is unusable.

    Wrong shape, dtype or device, an unknown sequence, or a non-finite value; the message names
    both sides of a mismatch, and for NaN/Inf the layer, head and token position.
    """

    exit_code = 2


class KVNonFiniteError(KVInputError):
    """NaN or Inf in K or V handed to the cache; nothing was written. `where` names the value,
    layer, KV head, token position and channel of the first one."""

    def __init__(self, where: str) -> None:
        super().__init__(f"non-finite {where}; nothing was written")
        self.where = where
