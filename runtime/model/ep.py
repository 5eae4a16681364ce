"""Expert parallelism as the model sees it: one collective call per MoE layer.

Shape legend: T tokens on this rank, D hidden, K top-k, W world size, Tmax max T over ranks.

    ep(x [T, D], topk_idx [T, K], topk_weight [T, K]) -> y [T, D]

Every rank calls every MoE layer's `ep` in every step, in the same order, even with T == 0: that
is what keeps ranks in lockstep (see docs/engine.md). Implementations:

    LocalExperts   world size 1 (or all experts local): no communication
    _TimedEP       runtime/moe's expert-parallel layer (torch.distributed or NVSHMEM backend)
    AllGatherEP    a fallback (`backend="allgather"`): all-gathers every rank's tokens, computes
                   this rank's experts for all of them, all-reduces the partial outputs and keeps
                   its own rows. Correct on gloo and NCCL, but moves W x the data a real
                   dispatch/combine does.

A model's layers are built by one `ExpertParallelWorld` (its `make_ep`), which picks among them
and owns what the layers share (the backend, an NVSHMEM session) and their lifetime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.model.local_experts import DenseLocalExperts, LocalExperts
from zerodram.runtime.model.moe import ExpertWeights
from zerodram.runtime.model.timing import NULL_TIMER, PhaseTimer

if TYPE_CHECKING:
    from zerodram.runtime.moe.layer import EpMoELayer


class ExpertParallel(Protocol):
    """One MoE layer's routed experts across ranks (collective: all ranks call it each step)."""

    def __call__(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> torch.Tensor: ...


def capturable_ep(ep: ExpertParallel) -> ExpertParallel | None:
    """A twin of `ep` that a CUDA graph can capture (static shapes, no host sync, no timers), or
    None. `LocalExperts` (one rank): its `RoutedLocalExperts` where it has one and torch has
    `_grouped_mm` for the bulk buckets (CUDA, bf16 weights the expert kernel takes), else
    `DenseLocalExperts`. Across ranks: runtime/moe's layer over a capturable communicator (NVSHMEM,
    its phase pinned by `ExpertParallelWorld`), untimed; every rank must then capture in step
    (docs/engine.md). The torch backend's host-driven exchange has none."""
    if isinstance(ep, _TimedEP):
        # a graph bakes the phase it was captured with: unpinned, replays would reuse a buffer
        # that peers' alternate-phase calls expect free
        comm = ep.layer.comm
        return _UntimedEP(ep.layer) if comm.capturable and comm.phase_pinned else None
    if not isinstance(ep, LocalExperts):
        return None
    from zerodram.runtime.moe.experts import has_grouped_mm

    if ep.routed is not None and has_grouped_mm("cuda", torch.bfloat16):
        return ep.routed
    return DenseLocalExperts(ep.experts)


class AllGatherEP:
    """STOPGAP expert parallelism over torch.distributed collectives (see module docstring).

    Args:
        experts: this rank's experts for the layer.
        world_size, rank: the process group's.
        group: the process group (default group when None).
    """

    def __init__(
        self,
        experts: ExpertWeights,
        world_size: int,
        rank: int,
        group: dist.ProcessGroup | None = None,
        timer: PhaseTimer = NULL_TIMER,
    ) -> None:
        self.experts = experts
        self.world_size = world_size
        self.rank = rank
        self.group = group
        self.timer = timer

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        W, (T, D), K = self.world_size, x.shape, topk_idx.shape[1]
        with self.timer.phase("dispatch"):
            num_tokens = torch.tensor([T], dtype=torch.int64)
            all_num_tokens = [torch.zeros_like(num_tokens) for _ in range(W)]
            dist.all_gather(all_num_tokens, num_tokens, group=self.group)  # host ints: gloo-friendly
            counts = [int(c.item()) for c in all_num_tokens]
            t_max = max(counts)
            if t_max == 0:
                return torch.zeros_like(x)
            # One packed row per token: hidden, then K ids and K weights as the same dtype (exact
            # for ids < 2^24 in fp32; bf16 can't hold ids > 256, so pack in fp32 always).
            send = torch.zeros(t_max, D + 2 * K, dtype=torch.float32, device=x.device)
            send[:T, :D] = x.float()
            send[:T, D : D + K] = topk_idx.float()
            send[:T, D + K :] = topk_weight.float()
            recv = [torch.empty_like(send) for _ in range(W)]
            dist.all_gather(recv, send, group=self.group)
            rows = torch.cat([r[:c] for r, c in zip(recv, counts, strict=True)])  # [sum T, D + 2K]
        with self.timer.phase("experts"):
            x_all = rows[:, :D].to(x.dtype)
            idx_all = rows[:, D : D + K].long()
            w_all = rows[:, D + K :].to(x.dtype)
            partial = self.experts.forward(x_all, idx_all, w_all)  # [sum T, D]
        with self.timer.phase("combine"):
            full = torch.zeros(W * t_max, D, dtype=torch.float32, device=x.device)
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            for r in range(W):
                full[r * t_max : r * t_max + counts[r]] = partial[offsets[r] : offsets[r + 1]].float()
            dist.all_reduce(full, group=self.group)
            return full[self.rank * t_max : self.rank * t_max + T].to(x.dtype)


def make_expert_parallel(
    experts: ExpertWeights,
    world_size: int,
    rank: int,
    timer: PhaseTimer = NULL_TIMER,
    *,
    ctx: object | None = None,
    expert_to_rank: tuple[int, ...] | None = None,
    top_k: int = 0,
    max_tokens_per_rank: int = 0,
    backend: str | None = None,
    session: object | None = None,
    every_token: bool = False,
    wire: str = "bf16",
    dtype: torch.dtype | None = None,
) -> ExpertParallel:
    """The expert-parallel layer for one MoE layer.

    World size 1: `LocalExperts`. Otherwise runtime/moe's `EpMoELayer` (torch.distributed or
    NVSHMEM backend, chosen once by its `create`; `session`: a shared NVSHMEM session) when a rank
    context is given, else the `AllGatherEP` stopgap. `backend="allgather"` forces the stopgap.
    A model's layers are built through `ExpertParallelWorld`, which shares what they can.
    every_token: the router sends every token to every expert (see `RoutedLocalExperts`).
    wire: how runtime/moe's layer sends rows to the experts' ranks (`EpLayout`); one rank sends none.
    dtype: the model's compute dtype, the rows' on every rank (None: the experts' weights').
    """
    if world_size == 1:
        return LocalExperts(experts, timer, every_token=every_token)
    if ctx is None or backend == "allgather":
        return AllGatherEP(experts, world_size, rank, timer=timer)
    from zerodram.runtime.moe.layer import EpMoELayer

    layer = EpMoELayer.create(
        ctx,
        experts,
        num_experts=len(expert_to_rank),
        top_k=top_k,
        max_tokens_per_rank=max_tokens_per_rank,
        placement=_placement(ctx, rank, world_size, expert_to_rank),
        wire=wire,
        dtype=dtype,
        backend=backend,
        session=session,
    )
    return _TimedEP(layer, timer)


def every_rank_hosts_an_expert(placement) -> bool:
    """Whether one phase of NVSHMEM buffers may serve every MoE layer (`ExpertParallelWorld`)."""
    return all(placement.local_experts(r) for r in range(placement.world_size))


def _placement(ctx: object, rank: int, world_size: int, expert_to_rank: tuple[int, ...]):
    """The comm layer's placement: the experts' ranks, and the topology's replicas and ring order
    when the topology places this model's experts (as the weights were loaded:
    `zerodram.runtime.loading.placement.expert_layout`)."""
    from zerodram.runtime.comm import ExpertPlacement as CommPlacement
    from zerodram.runtime.comm import from_topology

    topo = _placing_topology(ctx, len(expert_to_rank))
    return CommPlacement(rank, world_size, tuple(expert_to_rank)) if topo is None else from_topology(topo, rank)


def _placing_topology(ctx: object, num_experts: int):
    """The context's topology when it places `num_experts` experts (else None: contiguous blocks)."""
    topo = getattr(ctx, "topology", None)
    return topo if getattr(getattr(topo, "experts", None), "num_experts", None) == num_experts else None


class ExpertParallelWorld:
    """Builds every MoE layer's expert parallelism on this rank (a `Transformer`'s `make_ep`) and
    owns what the layers share and how long it lives.

    The backend is resolved once. On GPUs with the NVSHMEM backend, one `NvshmemSession` serves
    every layer's communicator: NVSHMEM is initialised once per process, and a session per layer
    would initialise it once per layer. The session is one-phase (every layer shares one phase of
    buffers, and the heap holds that one phase) where every rank hosts an expert. A rank without
    experts waits on no dispatch flag, so its combine flag of one call could overtake a peer's
    zeroing of the previous call's in the same buffer: there each layer keeps two phases and they
    alternate, unpinned (the chain then runs through the call in between), so decode runs eagerly
    across ranks (CUDA graphs need pinned phases: `capturable_ep`). `check()` raises a
    device wait's expiry (call it between steps: the engine does). `close()` ends the layers'
    communicators in layer order, then the session; it is collective (every rank closes) and
    idempotent.

    Hazard: NVSHMEM's init, symmetric allocation and barrier_all wait for every PE without a
    timeout. So each of those steps is preceded by the context's bounded host barrier, which
    names the step: a rank that failed earlier (a bad checkpoint, out of memory) turns into a
    `RankTimeoutError` on the others instead of a hang.

    Args:
        ctx: the rank context (None: one process, all experts local).
        timer: the model's phase timer.
        expert_to_rank, top_k, hidden: the model's experts and shapes.
        max_tokens_per_rank: the most tokens one step sends through a MoE layer (buffer sizing).
        num_moe_layers: how many layers will be built (the heap's size where they cannot share).
        backend: "auto", "torch", "nvshmem" or "allgather" (default: ZERODRAM_EP_BACKEND).
        dtype: the model's compute dtype: every layer's rows, on every rank (NVSHMEM moves bf16
            rows; see `resolve_backend`). None: each layer's expert weights'.
        every_token: the router sends every token to every expert with weight 1 (`dense_slices`).
        wire: the dispatch's row format across ranks, "bf16" or "fp8" (`EpLayout`; combine sends
            the model's rows either way). One rank sends nothing, so there it changes nothing.

    Raises:
        ConfigError: a wire the layers cannot send: unknown, a hidden size fp8's 128-channel
            scale groups do not divide, or fp8 through the all-gather stopgap.
    """

    def __init__(
        self,
        ctx: object | None,
        timer: PhaseTimer = NULL_TIMER,
        *,
        expert_to_rank: tuple[int, ...] | None,
        top_k: int,
        hidden: int,
        max_tokens_per_rank: int,
        num_moe_layers: int,
        backend: str | None = None,
        dtype: torch.dtype | None = None,
        every_token: bool = False,
        wire: str = "bf16",
    ) -> None:
        self.ctx, self.timer, self.every_token, self.wire = ctx, timer, every_token, wire
        self.dtype = dtype
        self.rank, self.world_size = getattr(ctx, "rank", 0), getattr(ctx, "world_size", 1)
        self.expert_to_rank, self.top_k, self.max_tokens = expert_to_rank, top_k, max_tokens_per_rank
        self.backend, self.session = backend, None
        self.pin = True  # pin each communicator to one phase (the NVSHMEM branch below may refuse)
        self.built: list[ExpertParallel] = []
        self._checked: tuple[int, list, list[torch.Tensor]] | None = None  # check()'s communicators
        if self.world_size == 1 or ctx is None:
            return
        if backend == "allgather":
            if wire != "bf16":
                raise ConfigError(
                    f"EP wire {wire!r} needs runtime/moe's EP layer; the allgather stopgap gathers whole rows"
                )
            topo = _placing_topology(ctx, len(expert_to_rank or ()))
            if topo is not None and topo.experts.num_replicas:
                # every owner would run the expert over every token, and the sum count it twice
                raise ConfigError(
                    "the topology's experts.replicas need the dispatch (--ep-backend torch or nvshmem); "
                    "the allgather stopgap computes each expert on every rank that holds it"
                )
            return
        from zerodram.runtime.comm import EpLayout, resolve_backend

        self.backend = resolve_backend(ctx, backend, dtype)
        if num_moe_layers:
            placement = _placement(ctx, self.rank, self.world_size, expert_to_rank)
            # as each EpMoELayer.create builds it; here once, so a wire the model cannot send fails
            # before the first layer's buffers
            rows = dtype or torch.bfloat16  # None: each layer's expert weights' (any a wire can carry)
            layout = EpLayout(placement, hidden, top_k, max_tokens_per_rank, wire, rows)
        if self.backend == "nvshmem" and num_moe_layers:
            from zerodram.runtime.comm.nvshmem_comm import heap_bytes
            from zerodram.runtime.comm.nvshmem_session import NvshmemSession

            # the engine calls each layer once per step, in layer order: one phase serves them all,
            # unless a rank hosts no expert (see the class docstring); the placement is global
            one = self.pin = every_rank_hosts_an_expert(placement)
            self._rendezvous("NVSHMEM init")
            self.session = NvshmemSession.create(
                ctx, heap_bytes=heap_bytes(layout, num_moe_layers, one_phase=one), one_phase=one
            )

    def check(self) -> None:
        """Raise `RankTimeoutError` naming the silent rank and expert if a device wait of this
        rank's NVSHMEM communicators expired (one small device-to-host copy; between steps)."""
        if self._checked is None or self._checked[0] != len(self.built):  # built by now: once
            comms = [ep.layer.comm for ep in self.built if isinstance(ep, _TimedEP) and hasattr(ep.layer.comm, "error")]
            self._checked = (len(self.built), comms, [c.error[0] for c in comms])  # NVSHMEM's error words
        _, comms, errors = self._checked
        if errors and any(torch.stack(errors).tolist()):
            for c in comms:
                c.check()

    def _rendezvous(self, what: str) -> None:
        """The context's bounded barrier before an NVSHMEM collective (see the class hazard)."""
        barrier = getattr(self.ctx, "barrier", None)
        if self.backend == "nvshmem" and barrier is not None:
            barrier(what)

    def __call__(self, layer_idx: int, experts: ExpertWeights) -> ExpertParallel:
        self._rendezvous(f"EP buffers of MoE layer {layer_idx}")
        ep = make_expert_parallel(
            experts,
            self.world_size,
            self.rank,
            self.timer,
            ctx=self.ctx,
            expert_to_rank=self.expert_to_rank,
            top_k=self.top_k,
            max_tokens_per_rank=self.max_tokens,
            backend=self.backend,
            session=self.session,
            every_token=self.every_token,
            wire=self.wire,
            dtype=self.dtype,
        )
        if isinstance(ep, _TimedEP) and self.pin:  # the engine calls each layer once per step: one phase serves
            ep.layer.comm.pin_phase()
        self.built.append(ep)
        return ep

    def close(self) -> None:
        if self.built or self.session is not None:
            self._rendezvous("closing the EP layers")
        for ep in self.built:
            close = getattr(ep, "close", None)
            if close is not None:
                close()
        self.built = []
        if self.session is not None:
            self.session.close()
            self.session = None


class _UntimedEP:
    """runtime/moe's EP layer as a CUDA graph captures it: the same three stages, no timers."""

    def __init__(self, layer: EpMoELayer) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        return self.layer(x, topk_idx, topk_weight)


class _TimedEP:
    """runtime/moe's EP layer, its three stages timed apart: dispatch, experts, combine.

    On CPU ranks the dispatch and combine times include waiting for the slowest rank (they are
    collectives); that wait is what the dashboard's phase mix should show.
    """

    def __init__(self, layer: EpMoELayer, timer: PhaseTimer) -> None:
        self.layer = layer
        self.timer = timer

    def close(self) -> None:
        self.layer.close()

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        from zerodram.runtime.moe.experts import grouped_swiglu

        layer = self.layer
        with self.timer.phase("dispatch"):
            out = layer.comm.dispatch(x, topk_idx=topk_idx, topk_weight=topk_weight)
        with self.timer.phase("experts"):
            y = grouped_swiglu(
                out.recv_x,
                out.recv_expert_offsets,
                layer.experts,
                layer.experts_path,
                sent_rows=out.topk_idx.numel(),
            )  # [N, D]
        with self.timer.phase("combine"):
            return layer.comm.combine(y, out)
