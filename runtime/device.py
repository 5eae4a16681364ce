"""One spelling per device, so that `x.device != self.device` compares what it means to."""

from __future__ import annotations

import torch


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` with its index filled in: "cuda" -> cuda:<current device>; CPU stays "cpu".

    Tensors always report an indexed CUDA device (cuda:0), while users write "cuda"; modules that
    check their inputs' device must store the indexed form.
    """
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


_CONSTANTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def constant_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module-level constant `t` on `device`, copied there once: later calls make no copy, so a
    CUDA graph capture may run them (a copy from pageable host memory is refused while capturing).
    Only for tensors that live as long as the process (module constants)."""
    key = (id(t), canonical_device(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = t.to(device)
    return _CONSTANTS[key]


class Staging:
    """A small host buffer (pinned on a GPU) and its device twin, for per-step uploads of indices:
    one copy per upload, and the host side is not rewritten before the previous copy has left it
    (the host waits for that copy: a caller cannot run ahead of the GPU by more than one upload).

    Args:
        shape, dtype: of both buffers.
        device: where the device twin lives (on CPU the two are plain tensors).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=cuda)
        self.dev = torch.zeros(shape, dtype=dtype, device=device)
        self._copied = torch.cuda.Event() if cuda else None

    def upload(self, values: list) -> torch.Tensor:
        """`values` (nested lists of `shape`) to the device; returns the device buffer."""
        if self._copied is not None:
            self._copied.synchronize()
        self.host.copy_(torch.tensor(values, dtype=self.host.dtype))
        self.dev.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.dev.device))  # the stream the copy ran on
        return self.dev
