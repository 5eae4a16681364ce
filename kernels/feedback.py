"""Launch wrapper of the error-feedback rounding kernel (kernels/cuda/fp2_feedback.cu).

Shape legend: T tokens, H KV heads, D head dim.

`feedback_codes_cuda` computes what runtime/kv/feedback.py's torch loop computes, bit for bit on the
same CUDA device (the kernel's header says why), in one launch: one warp per (token, head). It
validates its inputs once, allocates only the output, and launches on torch's current stream
without synchronising. One cubin per head dim, compiled on first use and cached (kernels/jit.py);
call `load_feedback_kernel` before a CUDA-graph capture.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions
from zerodram.kernels.module import launch, load_module, ptr
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.errors import KVInputError, expect_tensor

MAX_HEAD_DIM = 256  # PER = D / 32 values per lane and array stay in registers up to 8
NUM_WARPS = 4  # (token, head) pairs per CTA


def feedback_build_options(head_dim: int) -> BuildOptions:
    """Compile options of the kernel for one head dim."""
    return BuildOptions.make(
        arch="sm_90", defines={"HEAD_DIM": head_dim, "NUM_WARPS": NUM_WARPS}, extra=("-lineinfo",)
    )


def supports_head_dim(head_dim: int) -> bool:
    """Whether the kernel handles this head dim (any of 1..MAX_HEAD_DIM)."""
    return 1 <= head_dim <= MAX_HEAD_DIM


@cache
def _kernel(head_dim: int, device_index: int):
    # load_module caches per (options, current device); this skips rebuilding the options per call
    return load_module("fp2_feedback", feedback_build_options(head_dim)).kernel("fp2_feedback")


def load_feedback_kernel(head_dim: int, device: torch.device | str | None = None) -> None:
    """Compile and load the kernel for `head_dim` on `device` now (not inside a graph capture)."""
    dev = torch.device("cuda") if device is None else torch.device(device)
    with torch.cuda.device(dev):
        _kernel(head_dim, torch.cuda.current_device())


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    # strided inputs are read in place: only levels and factor must be contiguous
    expect_tensor(t, name, dtype, shape, device, owner="y", contiguous=name in ("levels", "factor"))


def feedback_codes_cuda(
    y: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    levels: torch.Tensor,
    factor: torch.Tensor,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """Codes of y rounded channel by channel with error feedback, on y's CUDA device.

    y: [T, H, D] fp32; scales / offsets: [T, H, D] fp32 per element, any strides (a broadcast view
    of the block values is read in place); offsets None for symmetric blocks; exact: [T, H, D]
    bool or None, elements kept exactly (their error is not fed forward); levels: [4] fp32,
    sorted, contiguous; factor: [H, D, D] fp32 contiguous, from `feedback_factor`. Every tensor
    on y's device. Returns uint8 [T, H, D] (contiguous, the only allocation).

    Raises:
        ConfigError: y not on a CUDA device, or a head dim over MAX_HEAD_DIM.
        KVInputError: a dtype, shape, device or contiguity mismatch (the message names both sides).
    """
    if y.device.type != "cuda":
        raise ConfigError(f"the feedback kernel runs on CUDA tensors, y is on {y.device}")
    if y.dim() != 3:
        raise KVInputError(f"y must be [T, H, D], got shape {tuple(y.shape)}")
    T, H, D = y.shape
    if not supports_head_dim(D):
        raise ConfigError(f"the feedback kernel handles head dims 1..{MAX_HEAD_DIM}, got {D}")
    dev = y.device
    _check(y, "y", torch.float32, (T, H, D), dev)
    _check(scales, "scales", torch.float32, (T, H, D), dev)
    if offsets is not None:
        _check(offsets, "offsets", torch.float32, (T, H, D), dev)
    if exact is not None:
        _check(exact, "exact", torch.bool, (T, H, D), dev)
    _check(levels, "levels", torch.float32, (4,), dev)
    _check(factor, "factor", torch.float32, (H, D, D), dev)
    codes = torch.empty(T, H, D, dtype=torch.uint8, device=dev)  # [T, H, D]
    if T * H == 0:
        return codes

    def strided(t: torch.Tensor | None) -> tuple:
        if t is None:
            return (np.uint64(0), np.int64(0), np.int64(0), np.int64(0))
        return (ptr(t), *(np.int64(s) for s in t.stride()))

    args = (
        *strided(y), *strided(scales), *strided(offsets), *strided(exact),
        ptr(levels), ptr(factor), ptr(codes), np.int32(T), np.int32(H),
    )  # fmt: skip
    with torch.cuda.device(dev):
        kernel = _kernel(D, dev.index)
        launch(kernel, grid=(-(-T * H // NUM_WARPS),), block=(32 * NUM_WARPS,), args=args)
    return codes
