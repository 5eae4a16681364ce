"""Errors raised by the KV cache: capacity (so the engine can queue or reject) and bad input."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodram.runtime.errors import ZerodramError

if TYPE_CHECKING:
    import torch


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


def expect_tensor(
    t: torch.Tensor,
    name: str,
    dtype: torch.dtype,
    shape: tuple,
    device: torch.device,
    *,
    owner: str,
    contiguous: bool = True,
) -> None:
    """Raise KVInputError unless t has this dtype, shape and device (and is contiguous): the one
    check the kernels' wrappers run on each input; `owner` names what sets the device ("y", "the
    attention module")."""
    if t.dtype != dtype:
        raise KVInputError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise KVInputError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.device != device:
        raise KVInputError(f"{name} is on {t.device}, {owner} on {device}")
    if contiguous and not t.is_contiguous():
        raise KVInputError(f"{name} must be contiguous")
