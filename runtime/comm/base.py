"""The communication interface of an expert-parallel MoE layer: dispatch, then combine.

Shape legend: T tokens on this rank, D hidden, K top-k, El local experts, N packed rows.

    out = comm.dispatch(x, topk_idx=..., topk_weight=...)      # or logits=..., or gate_weight=...
    y_packed = experts(out.recv_x, out.recv_expert_offsets)    # [N, D], this rank's experts
    y = comm.combine(y_packed, out)                            # [T, D], weighted by the router

Every rank calls dispatch and combine for every MoE layer, in the same order, even with T == 0.
Backends are chosen once, at construction (`runtime/comm/__init__.py:create_communicator`):
`TorchDistComm` (host-driven, gloo or NCCL) and `NvshmemComm` (device-initiated, GPU).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from zerodram.runtime.comm.layout import EpLayout
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.moe.router import RouterConfig, gate_logits, route


@dataclass(frozen=True)
class DispatchOutput:
    """What a dispatch delivers to this rank's experts, and what its combine needs.

    Attributes:
        recv_x: [N, D] packed rows, expert-major (see `layout`); rows past
            ``recv_expert_offsets[-1]`` are unspecified (the GPU path sizes N for the worst case).
        recv_expert_offsets: [El] int32 cumulative ends, the ``offs`` of `torch._grouped_mm`.
        recv_num_tokens_per_expert: [El] int32 rows per local expert.
        topk_idx: [T, K] int64, the routing this dispatch used (the fused router's output).
        topk_weight: [T, K] fp32.
        handle: backend state for `combine` (opaque).
    """

    recv_x: torch.Tensor
    recv_expert_offsets: torch.Tensor
    recv_num_tokens_per_expert: torch.Tensor
    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    handle: Any


def check_rows(rows: torch.Tensor, lay: EpLayout, what: str, num_rows: int | None = None) -> None:
    """Rows as the layout carries them: [T, D] (``num_rows`` of them where given) in the layout's
    dtype. Both backends check dispatch's x and combine's expert outputs with it, on every call,
    before anything is sent: a rank whose rows were of another dtype or width would send rows of
    another size than its peers expect, which they decode as garbage (gloo aborts the process
    when more bytes arrive than it posted). Local, so no collective: the layout is the same on
    every rank (built from the model's dtype), hence so is what this check lets through.

    Raises:
        ConfigError: naming this rank, the rows' shape and dtype, and the layout's.
    """
    width_ok = rows.dim() == 2 and rows.shape[1] == lay.hidden
    if not width_ok or num_rows not in (None, rows.shape[0]) or rows.dtype != lay.dtype:
        want = "T" if num_rows is None else num_rows
        raise ConfigError(
            f"rank {lay.rank}/{lay.world_size}: {what} is {list(rows.shape)} {rows.dtype}, the layout "
            f"expects [{want}, {lay.hidden}] {lay.dtype} (fixed at construction, the same on every rank)"
        )


def _check_topk(idx: torch.Tensor, weight: torch.Tensor | None, T: int, K: int, E: int) -> None:
    """Precomputed routing as the protocol needs it. Shapes and dtypes always; the ids' values
    only where they are on the host (reading device values would sync every call): below E, and
    no expert twice in a row, since a (expert, source) pair holds one slot per token (layout.py).
    Negative ids mean no expert."""
    if idx.shape != (T, K) or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ConfigError(f"topk_idx {tuple(idx.shape)} {idx.dtype}, layout expects [{T}, {K}] integers")
    if weight is None or weight.shape != (T, K):
        got = "none" if weight is None else tuple(weight.shape)
        raise ConfigError(f"topk_weight {got}, layout expects [{T}, {K}] beside topk_idx")
    if idx.device.type != "cpu" or not idx.numel():
        return
    if int(idx.max()) >= E:
        raise ConfigError(f"topk_idx names expert {int(idx.max())}, the layout has {E}")
    ids = idx.sort(dim=1).values  # [T, K]
    twice = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)  # [T, K - 1]
    if bool(twice.any()):
        t = int(twice.nonzero()[0, 0])
        raise ConfigError(f"token {t} picks an expert twice: {idx[t].tolist()}")


@dataclass(frozen=True)
class RouteInput:
    """Exactly one way of routing: precomputed (topk_idx, topk_weight), fp32 logits [T, E], or the
    gate weight [E, D] (the logits are then computed from the hidden states: `gate_logits`)."""

    topk_idx: torch.Tensor | None = None
    topk_weight: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    gate_weight: torch.Tensor | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name, v in (
                ("topk", self.topk_idx),
                ("logits", self.logits),
                ("gate_weight", self.gate_weight),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ConfigError(
                f"dispatch needs exactly one of topk_idx/logits/gate_weight, got {given or 'none'}"
            )
        if (self.topk_idx is None) != (self.topk_weight is None):
            raise ConfigError("topk_idx and topk_weight come together")

    @property
    def needs_router(self) -> bool:
        return self.topk_idx is None


class Communicator(ABC):
    """One MoE layer's dispatch/combine. Create through a backend's `create`; end with `close()`.

    Attributes:
        layout: sizes and placement (fixed at construction).
        router: how logits become choices (needed unless every dispatch passes topk).
        expert_load: [El] int64 running count of rows received per local expert (a dashboard reads
            it; updated on the device, never synchronised in the hot path).
    """

    layout: EpLayout
    router: RouterConfig | None
    expert_load: torch.Tensor
    # Whether a CUDA graph may capture its calls (device-side only: no host sync, fixed shapes),
    # once its owner has pinned it to one call per step (`pin_phase`).
    capturable: bool = False

    def pin_phase(self) -> None:  # noqa: B027 (a no-op unless the backend has phases)
        """Promise one dispatch and its combine per step, in that order (see NvshmemComm)."""

    @property
    def phase_pinned(self) -> bool:
        """Whether calls use one fixed phase (always, for a backend without phases)."""
        return True

    def dispatch(
        self,
        x: torch.Tensor,
        *,
        topk_idx: torch.Tensor | None = None,
        topk_weight: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        gate_weight: torch.Tensor | None = None,
    ) -> DispatchOutput:
        """Send each (token, choice) row to its expert's owner; receive this rank's rows.

        Args:
            x: [T, D] hidden states in layout.dtype, T <= layout.max_tokens_per_rank.
            topk_idx, topk_weight: [T, K] precomputed routing (-1 in topk_idx: no expert), or
            logits: [T, E] fp32, or gate_weight: [E, D] (then `router` scores them).

        Raises:
            ConfigError: shapes or x's dtype outside the layout (`check_rows`), or no router for
                logits. Raised before anything is sent: the peers then end their wait for this
                rank with `RankTimeoutError` naming it.
            RankTimeoutError: (host path) a peer did not join within the timeout.
        """
        lay = self.layout
        check_rows(x, lay, "dispatch's x")
        T = x.shape[0]
        if lay.max_tokens_per_rank < T:
            raise ConfigError(
                f"dispatch got {T} tokens, layout holds at most {lay.max_tokens_per_rank} per rank"
            )
        rin = RouteInput(topk_idx, topk_weight, logits, gate_weight)
        if rin.needs_router and self.router is None:
            raise ConfigError("dispatch from logits or gate weight needs a RouterConfig")
        E = lay.placement.num_experts
        if rin.topk_idx is not None:
            _check_topk(rin.topk_idx, rin.topk_weight, T, lay.top_k, E)
        if rin.logits is not None and rin.logits.shape != (T, E):
            raise ConfigError(f"logits {tuple(rin.logits.shape)}, layout expects [{T}, {E}]")
        if rin.gate_weight is not None and rin.gate_weight.shape != (E, lay.hidden):
            raise ConfigError(f"gate_weight {tuple(rin.gate_weight.shape)}, layout expects [{E}, {lay.hidden}]")
        if self.router is not None and (self.router.top_k, self.router.num_experts) != (lay.top_k, E):
            raise ConfigError(
                f"router routes top {self.router.top_k} of {self.router.num_experts} experts, "
                f"the layout top {lay.top_k} of {E}"
            )
        return self._dispatch(x, rin)

    def route_on_host(self, x: torch.Tensor, rin: RouteInput) -> tuple[torch.Tensor, torch.Tensor]:
        """The router in torch (what the fused kernel computes on the device)."""
        if not rin.needs_router:
            return rin.topk_idx.to(torch.int64), rin.topk_weight.float()
        assert self.router is not None
        logits = rin.logits if rin.logits is not None else gate_logits(x, rin.gate_weight)
        return route(logits, self.router)

    @abstractmethod
    def _dispatch(self, x: torch.Tensor, rin: RouteInput) -> DispatchOutput: ...

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        """Return each row's expert output to its source and reduce it there with router weights.

        Args:
            expert_out: [N, D] outputs in `dispatched.recv_x`'s packed order and shape, in
                layout.dtype (what `grouped_swiglu` returns for recv_x).
            dispatched: this layer's `dispatch` result.

        Returns:
            [T, D] in layout.dtype: sum_k topk_weight[t, k] * out(t, k).

        Raises:
            ConfigError: expert_out's shape or dtype is not recv_x's (`check_rows`), before
                anything is sent. Not cast: outputs in another dtype than the rows they came
                from mean experts computing in another dtype than the model.
            RankTimeoutError: (host path) a peer did not join within the timeout.
        """
        check_rows(expert_out, self.layout, "combine's expert_out", dispatched.recv_x.shape[0])
        return self._combine(expert_out, dispatched)

    @abstractmethod
    def _combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor: ...

    def check(self) -> None:  # noqa: B027 (optional hook: host-driven waits raise at once)
        """Raise `RankTimeoutError` if a device-side wait expired (reads an error word: syncs)."""

    @abstractmethod
    def close(self) -> None:
        """Free buffers and communication state. Idempotent."""

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def combine_reduce(recv: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """The source-side reduction both backends define: recv [T*K, D] rows by src_idx = t*K + k ->
    [T, D] fp32 sum of topk_weight[t, k] * recv[t*K + k] over k with topk_idx[t, k] >= 0."""
    T, K = topk_idx.shape
    w = torch.where(topk_idx >= 0, topk_weight.float(), 0.0)  # [T, K]
    return (recv.float().view(T, K, recv.shape[-1]) * w.unsqueeze(-1)).sum(1)
