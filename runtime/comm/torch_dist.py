"""Host-driven dispatch/combine over torch.distributed (gloo on CPU, NCCL on GPU): the baseline.

Shape legend: T tokens, D hidden, K top-k, W world size, Elm max local experts, El local
experts, S rows sent, R rows received, B bytes per row on the wire.

    dispatch   route on the host -> plan slots (`plan_send`) -> counts exchange [W, Elm]
               (gloo: one isend/irecv per peer in ring order, each wait bounded and naming the
               peer; NCCL: all_to_all_single + host sync) -> rows as bytes via all_to_all_single
               -> rows scattered into the packed expert-major layout (`packed_offsets`)
    combine    packed outputs back to arrival order -> all_to_all_single with the splits swapped
               -> `combine_reduce` with the router weights

It is "legacy" by design (a host sync between counts and data, exact-size buffers), not a mock:
the same slot, packing and reduction rules as the NVSHMEM kernels.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerodram.runtime.comm.base import Communicator, DispatchOutput, RouteInput, combine_reduce
from zerodram.runtime.comm.layout import EpLayout, fp8_dequantize, fp8_quantize, packed_offsets, plan_send
from zerodram.runtime.errors import RankTimeoutError
from zerodram.runtime.moe.router import RouterConfig

_TAG_COUNTS = 7001


@dataclass(frozen=True)
class _Handle:
    T: int
    recv_pos: torch.Tensor  # [R] packed position of each received row, arrival order
    send_src_idx: torch.Tensor  # [S] t*K + k of each sent row, send order
    send_rows: list[int]  # [W] rows sent to each rank
    recv_rows: list[int]  # [W] rows received from each rank
    dtype: torch.dtype


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
        lay = self.layout
        W, Elm, D, K = lay.world_size, lay.placement.max_local_experts, lay.hidden, lay.top_k
        T = x.shape[0]
        topk_idx, topk_weight = self.route_on_host(x, rin)  # [T, K]
        plan = plan_send(topk_idx, lay.placement)
        flat_dst = plan.dst_rank.flatten()
        valid = flat_dst >= 0
        # send order: by destination, then local expert, then slot: the receiver derives (le, slot)
        # of every row from the counts alone
        key = (
            flat_dst * Elm + plan.local_expert_idx.flatten()
        ) * lay.max_tokens_per_rank + plan.slot.flatten()
        send_src_idx = torch.nonzero(valid).flatten()
        send_src_idx = send_src_idx[torch.argsort(key[send_src_idx])]  # [S] t*K + k
        pair = (flat_dst * Elm + plan.local_expert_idx.flatten())[send_src_idx]
        send_counts = torch.bincount(pair, minlength=W * Elm).view(W, Elm)  # [W, Elm]

        recv_counts = self._exchange_counts(send_counts)  # [W(src), Elm], host
        send_rows = send_counts.sum(1).tolist()
        recv_rows = recv_counts.sum(1).tolist()

        payload = self._encode(x[send_src_idx // K], send_src_idx)  # [S, B]
        recv_payload = torch.empty(sum(recv_rows), payload.shape[1], dtype=torch.uint8, device=x.device)
        self._all_to_all(recv_payload, payload, recv_rows, send_rows, "dispatch rows")
        rows, recv_src_idx = self._decode(recv_payload, x.dtype)  # [R, D], [R]

        El = lay.num_local_experts
        counts_le_src = recv_counts[:, :El].t().contiguous()  # [El, W]
        pair_offsets, expert_offsets = packed_offsets(counts_le_src)
        # arrival order is (src, le, slot); the packed position is pair_offsets[le, src] + slot
        seg = recv_counts[:, :El].flatten()  # [W*El] in (src, le) order
        seg_src = torch.arange(W).repeat_interleave(El)
        seg_le = torch.arange(El).repeat(W)
        row_seg = torch.repeat_interleave(torch.arange(W * El), seg)
        seg_start = torch.cumsum(seg, 0) - seg
        slot = torch.arange(row_seg.numel()) - seg_start[row_seg]
        recv_pos = (pair_offsets[seg_le[row_seg], seg_src[row_seg]].to(torch.int64) + slot).to(x.device)
        recv_x = torch.empty(rows.shape[0], D, dtype=x.dtype, device=x.device)
        recv_x[recv_pos] = rows
        num_per_expert = counts_le_src.sum(1).to(torch.int32)
        self.expert_load += num_per_expert.to(self.expert_load.device)
        del recv_src_idx  # arrival order already maps back; kept on the wire for parity with the GPU
        handle = _Handle(T, recv_pos, send_src_idx, send_rows, recv_rows, x.dtype)
        return DispatchOutput(
            recv_x,
            expert_offsets.to(x.device),
            num_per_expert.to(x.device),
            topk_idx,
            topk_weight,
            handle,
        )

    def _encode(self, rows: torch.Tensor, src_idx: torch.Tensor) -> torch.Tensor:
        """rows [S, D] + src_idx [S] -> bytes [S, B]: values (or fp8 values + scales), then src_idx."""
        idx_bytes = src_idx.to(torch.int32).unsqueeze(1).contiguous().view(torch.uint8)  # [S, 4]
        if self.layout.wire == "fp8":
            q, scale = fp8_quantize(rows)
            parts = [q.view(torch.uint8), scale.contiguous().view(torch.uint8)]
        else:
            parts = [rows.contiguous().view(torch.uint8)]
        return torch.cat([*parts, idx_bytes], dim=1)

    def _decode(self, payload: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        D = self.layout.hidden
        idx = payload[:, -4:].contiguous().view(torch.int32).flatten()
        if self.layout.wire == "fp8":
            q = payload[:, :D].contiguous().view(torch.float8_e4m3fn)
            scale = payload[:, D : D + 4 * (D // 128)].contiguous().view(torch.float32)
            return fp8_dequantize(q, scale, dtype), idx
        elem = torch.empty((), dtype=dtype).element_size()
        return payload[:, : D * elem].contiguous().view(dtype), idx

    # -- combine -------------------------------------------------------------------------------

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        h: _Handle = dispatched.handle
        K, D = self.layout.top_k, self.layout.hidden
        send = expert_out[h.recv_pos].to(h.dtype).contiguous()  # [R, D] back in arrival order
        recv = torch.empty(len(h.send_src_idx), D, dtype=h.dtype, device=expert_out.device)
        self._all_to_all(recv, send, h.send_rows, h.recv_rows, "combine rows")
        buf = torch.zeros(h.T * K, D, dtype=torch.float32, device=expert_out.device)
        buf[h.send_src_idx] = recv.float()
        return combine_reduce(buf, dispatched.topk_idx, dispatched.topk_weight).to(h.dtype)

    # -- collectives, bounded ----------------------------------------------------------------------

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """send_counts [W, Elm] -> recv_counts [W, Elm] on the host (the legacy path's host sync)."""
        lay = self.layout
        if self.backend == "nccl":
            dev = send_counts.to(self.device).contiguous()
            out = torch.empty_like(dev)
            self._all_to_all(out, dev, None, None, "dispatch counts")
            return out.cpu()
        recv = torch.zeros_like(send_counts)
        recv[lay.rank] = send_counts[lay.rank]
        peers = [p for p in lay.placement.ring_peers if p != lay.rank]
        sends = [
            dist.isend(send_counts[p].contiguous(), dst=p, group=self.group, tag=_TAG_COUNTS) for p in peers
        ]
        bufs = {p: torch.zeros_like(send_counts[p]) for p in peers}
        recvs = {p: dist.irecv(bufs[p], src=p, group=self.group, tag=_TAG_COUNTS) for p in peers}
        deadline = time.monotonic() + self.timeout_s
        for p in peers:
            self._wait(recvs[p], deadline, f"dispatch counts from rank {p}")
            recv[p] = bufs[p]
        for p, work in zip(peers, sends, strict=True):
            self._wait(work, deadline, f"rank {p} to take its dispatch counts")
        return recv

    def _wait(self, work: dist.Work, deadline: float, what: str) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as err:
            raise self._timeout(what, err) from err
        if ok is False:
            raise self._timeout(what, None)

    def _all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int] | None,
        in_splits: list[int] | None,
        what: str,
    ) -> None:
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except RuntimeError as err:
            raise self._timeout(what + " (all_to_all)", err) from err

    def _timeout(self, what: str, err: BaseException | None) -> RankTimeoutError:
        lay = self.layout
        cause = f": {str(err).strip().splitlines()[0]}" if err is not None and str(err).strip() else ""
        return RankTimeoutError(
            f"rank {lay.rank}/{lay.world_size} waited {self.timeout_s:g}s for {what}{cause}"
        )

    def close(self) -> None:
        self._closed = True  # nothing owned beyond tensors; the process group is the context's
