"""Loading compiled kernels and launching them on PyTorch's current stream (needs a GPU).

    mod = load_module("smoke")                        # compiles or takes the cached cubin
    launch(mod.kernel("fill_pattern"), grid=(n_blocks,), block=(256,),
           args=(ptr(out), np.int32(n), np.uint32(seed)))

Arguments are passed by value as numpy scalars of the exact C type (`ptr()` gives a uint64 for a
tensor's address); a Python int would be sized by cuda.core, not by the kernel's signature.
Launches are asynchronous on `torch.cuda.current_stream()` and safe under CUDA graph capture.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions, compile_cubin


class _TorchStream:
    """Adapts a torch stream to cuda.core's `__cuda_stream__` protocol."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


@cache
def _core_device(index: int) -> Any:
    from cuda.core import Device

    dev = Device(index)
    dev.set_current()  # the primary context, which torch uses too
    return dev


@cache
def _core_stream(device_index: int, handle: int) -> Any:
    return _core_device(device_index).create_stream(_TorchStream(handle))


class KernelModule:
    """One compiled `.cu` file loaded on the current device; `kernel(name)` looks up a function."""

    def __init__(self, name: str, opts: BuildOptions) -> None:
        from cuda.core import ObjectCode

        self.name, self.opts = name, opts
        _core_device(torch.cuda.current_device())
        self._obj = ObjectCode.from_cubin(compile_cubin(name, opts))
        self._kernels: dict[str, Any] = {}

    def kernel(self, fn_name: str) -> Any:
        if fn_name not in self._kernels:
            self._kernels[fn_name] = self._obj.get_kernel(fn_name)
        return self._kernels[fn_name]


@cache
def _load(name: str, opts: BuildOptions, device_index: int) -> KernelModule:
    return KernelModule(name, opts)


def load_module(name: str, opts: BuildOptions | None = None) -> KernelModule:
    """Compile (or fetch) `kernels/cuda/<name>.cu` and load it on the current CUDA device."""
    return _load(name, opts or BuildOptions(), torch.cuda.current_device())


@cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (the unit the grid-size choices count in)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's device address as the kernel's pointer argument."""
    return np.uint64(t.data_ptr())


def launch(
    kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0
) -> None:
    """Launch `kernel` on torch's current stream (asynchronous)."""
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch

    stream = torch.cuda.current_stream()
    core_stream = _core_stream(stream.device.index, stream.cuda_stream)
    if shared_mem > 48 * 1024 and shared_mem > _shared_limit.get((int(kernel.handle), stream.device.index), 48 * 1024):
        raise ValueError(
            f"launch asks for {shared_mem} bytes of dynamic shared memory; call allow_shared_memory(kernel, ...) "
            "first (outside any graph capture)"
        )
    core_launch(core_stream, LaunchConfig(grid=grid, block=block, shmem_size=shared_mem), kernel, *args)


_shared_limit: dict[tuple[int, int], int] = {}  # (CUkernel handle, device) -> dynamic shared memory allowed


def allow_shared_memory(kernel: Any, nbytes: int) -> None:
    """Let `kernel` launch with up to `nbytes` of dynamic shared memory on the current device (the
    default cap is 48 KB). Call it when loading the kernel, not inside a graph capture.

    Raises:
        RuntimeError: the driver refused (e.g. more than the device's per-block maximum).
    """
    from cuda.bindings import driver

    dev = torch.cuda.current_device()
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    # cuda.core loads through the library API: the handle is a CUkernel, set per device
    (err,) = driver.cuKernelSetAttribute(attr, nbytes, kernel.handle, driver.CUdevice(dev))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelSetAttribute(max dynamic shared memory = {nbytes}) failed: {err}")
    _shared_limit[(int(kernel.handle), dev)] = nbytes
