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
