"""SwiGLU experts of one rank's shard, run over the expert-major packed rows of a dispatch.

Shape legend: N packed rows, D hidden, F expert FFN dim, El local experts, Fs shared FFN dim.

    y = down(silu(gate(x)) * up(x))

`grouped_swiglu` runs one of three paths (`ExpertsPath`):

    kernel   decode-sized steps on CUDA, bf16: kernels/cuda/moe_experts.cu streams each active
             expert's weights once with the few rows on the MMA's narrow side (an expert with more
             than 32 rows re-reads its weights per 32, so bulk steps go to `grouped`)
    grouped  `torch._grouped_mm` when this torch has it for the device and dtype (probed once with a
             tiny problem): tiled for many rows per expert
    loop     one matmul per expert (reads the counts on the host: not capturable in a CUDA graph);
             the reference the other two are tested against

Every path is capturable except `loop`, and none syncs the host except `loop`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

from zerodram.runtime.errors import ConfigError

ExpertsPath = Literal["kernel", "grouped", "loop"]
EXPERTS_PATHS: tuple[ExpertsPath, ...] = ("kernel", "grouped", "loop")

# A step is decode-sized when the rows this rank sent into the dispatch (tokens * top-k) are at most
# this many per local expert: with balanced routing an expert then gets ~16 rows, and the kernel's
# 32-row pass holds even a 2x hot expert in one read of its weights.
KERNEL_ROWS_PER_EXPERT = 16


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [N, D], w_gate/w_up [F, D], w_down [D, F] -> [N, D]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


@dataclass(frozen=True)
class ExpertShard:
    """The experts one rank hosts for one layer (same field names as the model's ExpertWeights).

    Attributes:
        expert_ids: global id of each local expert, ascending (== placement.local_experts(rank)).
        w_gate, w_up: [El, F, D]; w_down: [El, D, F].
    """

    expert_ids: tuple[int, ...]
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    def __post_init__(self) -> None:
        El = len(self.expert_ids)
        if self.w_gate.shape[0] != El or self.w_up.shape != self.w_gate.shape:
            raise ConfigError(
                f"expert shard lists {El} experts, gate/up weights are {tuple(self.w_gate.shape)} / "
                f"{tuple(self.w_up.shape)}"
            )
        if self.w_down.shape != (El, self.w_gate.shape[2], self.w_gate.shape[1]):
            raise ConfigError(
                f"w_down {tuple(self.w_down.shape)} does not match w_gate {tuple(self.w_gate.shape)}"
            )

    @property
    def num_local_experts(self) -> int:
        return len(self.expert_ids)


@dataclass(frozen=True)
class SharedExpertWeights:
    """An expert every token goes through: w_gate/w_up [Fs, D], w_down [D, Fs]."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w_gate, self.w_up, self.w_down)


@cache
def has_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` exists and runs for (device, dtype): probed once, cached."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 16, device=device_type, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
        offs = torch.tensor([2, 4], device=device_type, dtype=torch.int32)
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return bool((y.float() == 16.0).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def kernel_applies(shard: ExpertShard, x: torch.Tensor | None = None) -> bool:
    """Whether the decode kernel takes these weights (CUDA, bf16, dims multiple of 32) and rows x
    (same device and dtype; None: any rows that match the weights)."""
    from zerodram.kernels.experts import supports_shapes

    w = shard.w_gate
    return (
        w.device.type == "cuda"
        and w.dtype == torch.bfloat16
        and (x is None or (x.device == w.device and x.dtype == w.dtype))
        and supports_shapes(w.shape[2], w.shape[1])
    )


def decode_sized(sent_rows: int | None, num_local_experts: int) -> bool:
    """Whether a step that sent `sent_rows` rows (tokens * top-k) is decode-sized for this shard."""
    return sent_rows is not None and sent_rows <= KERNEL_ROWS_PER_EXPERT * num_local_experts


def choose_experts_path(x: torch.Tensor, shard: ExpertShard, sent_rows: int | None) -> ExpertsPath:
    """`kernel` for a decode-sized step where it applies, else `grouped` where available, else `loop`."""
    if decode_sized(sent_rows, shard.num_local_experts) and kernel_applies(shard, x):
        return "kernel"
    return "grouped" if has_grouped_mm(x.device.type, x.dtype) else "loop"


def grouped_swiglu(
    x: torch.Tensor,
    recv_expert_offsets: torch.Tensor,
    shard: ExpertShard,
    path: ExpertsPath | None = None,
    *,
    sent_rows: int | None = None,
) -> torch.Tensor:
    """SwiGLU of each packed segment through its expert.

    Args:
        x: [N, D] packed rows (rows past ``recv_expert_offsets[-1]`` are ignored).
        recv_expert_offsets: [El] int32 cumulative ends of each local expert's rows.
        shard: this rank's experts (weights in x's dtype).
        path: force a path (None: `kernel` for a decode-sized step where it applies, else `grouped`
            where available, else `loop`).
        sent_rows: rows this rank sent into the dispatch (tokens * top-k), the host-side size hint
            that makes a step decode-sized (at most KERNEL_ROWS_PER_EXPERT per local expert); None:
            not decode-sized.

    Returns:
        [N, D] in x's dtype; rows past the last offset are unspecified.
    """
    if path is not None and path not in EXPERTS_PATHS:
        raise ConfigError(f"experts path {path!r} is not one of {EXPERTS_PATHS}")
    if shard.num_local_experts == 0 or x.shape[0] == 0:
        return torch.zeros_like(x)
    path = path or choose_experts_path(x, shard, sent_rows)
    if path == "kernel":
        from zerodram.kernels.experts import swiglu_experts_cuda

        x = x.contiguous()
        if x.data_ptr() % 16:  # a view into a bigger buffer: the kernel reads rows 16 bytes at a time
            x = x.clone()
        offs = recv_expert_offsets.to(torch.int32).contiguous()
        return swiglu_experts_cuda(x, offs, shard.w_gate, shard.w_up, shard.w_down)
    if path == "grouped":
        offs = recv_expert_offsets.to(torch.int32)
        g = torch._grouped_mm(x, shard.w_gate.transpose(-2, -1), offs=offs)  # [N, F]
        u = torch._grouped_mm(x, shard.w_up.transpose(-2, -1), offs=offs)  # [N, F]
        return torch._grouped_mm(F.silu(g) * u, shard.w_down.transpose(-2, -1), offs=offs)  # [N, D]
    out = torch.zeros_like(x)
    ends = recv_expert_offsets.tolist()  # host sync: the reference path only
    start = 0
    for le, end in enumerate(ends):
        if end > start:
            out[start:end] = swiglu(x[start:end], shard.w_gate[le], shard.w_up[le], shard.w_down[le])
        start = end
    return out
