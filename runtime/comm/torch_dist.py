"""Host-driven dispatch/combine over torch.distributed (gloo on CPU, NCCL on GPU): the baseline.

Shape legend: T tokens, D hidden, K top-k, W world size, Elm max local experts, El local
experts, P = W * Elm pairs, S rows sent, R rows received, B bytes per row on the wire.

    dispatch   route (given, or the router in torch) -> send order and per-pair counts on the
               device (`HostPlanner.send`: a sort and a scatter-add) -> counts exchange [W, Elm]
               and the ONE host sync (NCCL: all_to_all_single, then one copy of send and receive
               counts to the host; gloo: one isend/irecv per peer, each wait bounded and naming
               the peer) -> rows gathered and sent as bytes by one all_to_all_single -> packed
               positions from the counts on the host (`HostPlanner.recv`), one copy to the device,
               one gather into the expert-major layout
    combine    packed outputs gathered back to arrival order -> one all_to_all_single with the
               splits swapped -> rows put at their t*K + k -> `combine_reduce` with router weights

It is "legacy" by design (a host sync between counts and data, exact-size buffers), not a strawman:
a fixed handful of tensor ops per call, the same slot, packing and reduction rules as the NVSHMEM
kernels. `on_stage` lets a benchmark time the stages (plan, counts, rows, unpack / gather, rows,
reduce); it is a no-op otherwise.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from zerodram.runtime.comm.base import Communicator, DispatchOutput, RouteInput, combine_reduce
from zerodram.runtime.comm.host_plan import HostPlanner
from zerodram.runtime.comm.layout import EpLayout, fp8_dequantize, fp8_quantize
from zerodram.runtime.errors import RankTimeoutError
from zerodram.runtime.moe.router import RouterConfig

_TAG_COUNTS = 7001


def _no_stage(name: str) -> None:
    pass


@dataclass(frozen=True)
class _Handle:
    T: int
    recv_pos: torch.Tensor  # [R] int32 packed position of each received row, arrival order
    send_src_idx: torch.Tensor  # [S] int64 t*K + k of each sent row, send order
    send_rows: list[int]  # [W] rows sent to each rank
    recv_rows: list[int]  # [W] rows received from each rank


class TorchDistComm(Communicator):
    """The host-driven backend. Build with `TorchDistComm.create`."""

    def __init__(
        self,
        layout: EpLayout,
        router: RouterConfig | None,
        device: torch.device,
        backend: str,
        timeout_s: float,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.layout = layout
        self.router = router
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self.group = group
        self.expert_load = torch.zeros(layout.num_local_experts, dtype=torch.int64, device=device)
        self.planner = HostPlanner(layout.placement, layout.top_k, layout.max_tokens_per_rank, device)
        P = self.planner.num_pairs
        # [send | recv] counts, each P + 1 long (the last entry counts masked choices): one buffer so
        # that one device->host copy brings both (the path's one host sync)
        self._counts = torch.zeros(2, P + 1, dtype=torch.int64, device=device)
        self.on_stage: Callable[[str], None] = _no_stage
        self._closed = False

    @classmethod
    def create(
        cls,
        ctx: object,
        layout: EpLayout,
        router: RouterConfig | None = None,
        *,
        timeout_s: float | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> TorchDistComm:
        """From a `RankContext` (rank, world_size, device, backend, timeout_s).

        Raises:
            ConfigError: the layout's rank or world size differs from the context's.
        """
        from zerodram.runtime.comm import check_layout_matches

        check_layout_matches(layout, ctx)
        return cls(layout, router, ctx.device, ctx.backend, timeout_s or ctx.timeout_s, group)

    # -- dispatch ------------------------------------------------------------------------------

    def _dispatch(self, x: torch.Tensor, rin: RouteInput) -> DispatchOutput:
        lay, stage = self.layout, self.on_stage
        K, El = lay.top_k, lay.num_local_experts
        T, dev = x.shape[0], x.device
        topk_idx, topk_weight = self.route_on_host(x, rin)  # [T, K]
        topk_idx = topk_idx.to(dev)
        plan = self.planner.send(topk_idx, self._counts[0])
        stage("plan")
        counts = self._exchange_counts()  # host [2, W, Elm]: send, recv
        send_rows = counts[0].sum(1).tolist()
        recv_rows = counts[1].sum(1).tolist()
        stage("counts")
        send_src_idx = plan.order[: sum(send_rows)]  # [S] routed entries come first
        payload = self._encode(x.index_select(0, send_src_idx // K))  # [S, B]
        recv_payload = torch.empty(sum(recv_rows), payload.shape[1], dtype=torch.uint8, device=dev)
        # the packed positions need only the counts: work them out while the rows travel (NCCL)
        recv = self.planner.recv(counts[1])
        R = recv.num_rows
        idx_host = np.concatenate(
            [recv.recv_pos, recv.packed_src, recv.recv_expert_offsets, recv.recv_num_tokens_per_expert]
        ).astype(np.int32)
        idx = torch.from_numpy(idx_host).to(dev, non_blocking=True)  # one host->device copy
        recv_pos, packed_src = idx[:R], idx[R : 2 * R]
        expert_offsets, num_per_expert = idx[2 * R : 2 * R + El], idx[2 * R + El :]
        self._all_to_all(recv_payload, payload, recv_rows, send_rows, "dispatch rows")
        stage("rows")
        recv_x = self._decode(recv_payload.index_select(0, packed_src))  # [R, D] packed
        self.expert_load += num_per_expert
        stage("unpack")
        handle = _Handle(T, recv_pos, send_src_idx, send_rows, recv_rows)
        return DispatchOutput(recv_x, expert_offsets, num_per_expert, topk_idx, topk_weight, handle)

    def _encode(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [S, D] -> bytes [S, B]: the values (layout.dtype), or fp8 values then fp32 scales.
        The row's src_idx does not travel: its arrival position says it (counts + token order).
        Hazard: the peers size their receive buffers with their own B, so rows must be in the
        layout's dtype (`dispatch` checks it): bytes of another row size arrive as garbage, or
        abort the process in gloo."""
        if self.layout.wire == "fp8":
            q, scale = fp8_quantize(rows)
            return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)
        return rows.contiguous().view(torch.uint8)

    def _decode(self, payload: torch.Tensor) -> torch.Tensor:
        D, dtype = self.layout.hidden, self.layout.dtype
        if self.layout.wire == "fp8":
            q = payload[:, :D].view(torch.float8_e4m3fn)
            scale = payload[:, D:].view(torch.float32)  # row stride D + 4*D/128: 4-byte aligned
            return fp8_dequantize(q, scale, dtype)
        return payload.view(dtype)

    # -- combine -------------------------------------------------------------------------------

    def _combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        h: _Handle = dispatched.handle
        lay, stage = self.layout, self.on_stage
        K, D, dtype = lay.top_k, lay.hidden, lay.dtype
        send = expert_out.index_select(0, h.recv_pos)  # [R, D] back in arrival order
        stage("gather")
        recv = torch.empty(h.send_src_idx.shape[0], D, dtype=dtype, device=expert_out.device)
        self._all_to_all(recv, send, h.send_rows, h.recv_rows, "combine rows")
        stage("rows")
        buf = torch.zeros(h.T * K, D, dtype=dtype, device=expert_out.device)  # masked rows stay 0
        buf.index_copy_(0, h.send_src_idx, recv)
        y = combine_reduce(buf, dispatched.topk_idx, dispatched.topk_weight).to(dtype)
        stage("reduce")
        return y

    # -- collectives, bounded ----------------------------------------------------------------------

    def _exchange_counts(self) -> np.ndarray:
        """self._counts[0] (send counts) -> self._counts[1] (recv counts); returns both as host
        [2, W, Elm]: the path's one host sync."""
        lay = self.layout
        W, Elm, P = lay.world_size, lay.placement.max_local_experts, self.planner.num_pairs
        send, recv = self._counts[0, :P], self._counts[1, :P]  # [W*Elm] each, contiguous
        if self.backend == "nccl":
            self._all_to_all(recv, send, None, None, "dispatch counts")
            return self._counts[:, :P].cpu().numpy().reshape(2, W, Elm)
        send_h = send.cpu().view(W, Elm)  # gloo: the counts live on the host already (CPU ranks)
        recv_h = torch.empty_like(send_h)
        recv_h[lay.rank] = send_h[lay.rank]
        peers = [p for p in lay.placement.ring_peers if p != lay.rank]
        t0 = time.monotonic()
        sends, recvs = [], []
        for p in peers:
            try:  # posting fails at once when the peer has gone already
                sends.append(dist.isend(send_h[p], dst=p, group=self.group, tag=_TAG_COUNTS))
                recvs.append(dist.irecv(recv_h[p], src=p, group=self.group, tag=_TAG_COUNTS))
            except RuntimeError as err:
                raise self._failed(f"the dispatch counts exchange with rank {p}", t0, err) from err
        for p, work in zip(peers, recvs, strict=True):
            self._wait(work, t0, f"dispatch counts from rank {p}")
        for p, work in zip(peers, sends, strict=True):
            self._wait(work, t0, f"rank {p} to take its dispatch counts")
        return torch.stack([send_h, recv_h]).numpy()

    def _wait(self, work: dist.Work, t0: float, what: str) -> None:
        left = max(t0 + self.timeout_s - time.monotonic(), 0.001)
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as err:
            raise self._failed(what, t0, err) from err
        if ok is False:
            raise self._failed(what, t0, None)

    def _all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int] | None,
        in_splits: list[int] | None,
        what: str,
    ) -> None:
        t0 = time.monotonic()
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except RuntimeError as err:
            # a collective takes no timeout of its own: the process group's bounds it (the
            # context's timeout_s when the context made the group), not self.timeout_s
            limit = "limit: the process group's timeout"
            raise self._failed(f"{what} (all_to_all)", t0, err, limit) from err

    def _failed(
        self, what: str, t0: float, err: BaseException | None, limit: str | None = None
    ) -> RankTimeoutError:
        """The error for a wait on peers that ended badly: timed out, or failed early because a
        peer crashed, hence the real elapsed time beside the limit."""
        lay, limit = self.layout, limit or f"limit {self.timeout_s:g}s"
        cause = f": {str(err).strip().splitlines()[0]}" if err is not None and str(err).strip() else ""
        return RankTimeoutError(
            f"rank {lay.rank}/{lay.world_size}: waiting for {what} failed after "
            f"{time.monotonic() - t0:.1f}s ({limit}){cause}"
        )

    def close(self) -> None:
        self._closed = True  # nothing owned beyond tensors; the process group is the context's
