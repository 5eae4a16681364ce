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
