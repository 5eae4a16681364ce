"""Device-initiated dispatch/combine over NVSHMEM symmetric memory (GPU).

Shape legend: T tokens, D hidden, K top-k, W world size, El local experts, Elm max local
experts, Tm max tokens per rank, N = Elm * W * Tm packed-row capacity.

Per call: dispatch = [gate logits: one GEMM, when routing from the gate weight] + send (fused
router: each token's top-k and weights, its rows stored into owners' slabs through peer pointers,
count flags) + wait (bounded) + pack; combine = send back + wait (bounded) + reduce. Six launches
(seven with the GEMM), no host sync, worst-case sizes: capturable in a CUDA graph. Two phases of
every buffer alternate between consecutive calls, so a caller may dispatch again before it has
combined; an owner that makes one call per step pins one phase (`pin_phase`: what the engine does,
for its graphs). On a session made with `one_phase` (the engine's), every communicator is pinned
from the start and all of them share one phase of buffers: the argument of `pin_phase` holds across
layers as across steps, and the symmetric heap no longer grows with the layer count (a
DeepSeek-V3-like layer at EP 8 and 128 tokens per rank takes 462 MiB a phase). Not where a rank
hosts no expert (`pin_phase`).

Peers are reached by peer pointers (same GPU, NVLink domain). Peers on other nodes need the
put-with-signal kernel (`kernels/cuda/dispatch_remote.cu`), which needs the NVSHMEM device library
linked into an NVRTC module: not available with the pip wheels yet, so construction fails with a
message naming the unreachable rank. A device wait that expires sets an error word instead of
hanging; `check()` turns it into `RankTimeoutError` naming the silent rank and expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerodram.kernels.dispatch import ROUTE_LOGITS, ROUTE_TOPK, DispatchKernels, SendArgs
from zerodram.runtime.comm.base import Communicator, DispatchOutput, RouteInput
from zerodram.runtime.comm.layout import EpLayout
from zerodram.runtime.comm.nvshmem_session import NvshmemSession
from zerodram.runtime.errors import ConfigError, RankTimeoutError
from zerodram.runtime.moe.router import RouterConfig, gate_logits

_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class SymmetricLayout:
    """Byte offsets inside one phase of the symmetric buffer (mirrors moe_layout.cuh)."""

    off_msg: int
    off_info: int
    off_flag: int
    off_comb: int
    off_comb_flag: int
    off_arrive: int
    phase_bytes: int

    @staticmethod
    def of(lay: EpLayout) -> SymmetricLayout:
        W, Elm, Tm = lay.world_size, lay.placement.max_local_experts, lay.max_tokens_per_rank
        cap = lay.recv_capacity
        sizes = [
            ("msg", cap * lay.msg_bytes),
            ("info", cap * 4),
            ("flag", Elm * W * 8),
            ("comb", Tm * lay.top_k * lay.hidden * 2),
            ("comb_flag", W * 8),
            ("arrive", Elm * W * 8),
        ]
        offs, at = {}, 0
        for name, size in sizes:
            offs[f"off_{name}"] = at
            at += _align(size)
        return SymmetricLayout(phase_bytes=at, **offs)


@dataclass(frozen=True)
class _Handle:
    phase: int
    T: int


class NvshmemComm(Communicator):
    """The device-initiated backend. Build with `NvshmemComm.create`; end with `close()`."""

    capturable = True

    @classmethod
    def create(
        cls,
        ctx: Any,
        layout: EpLayout,
        router: RouterConfig | None = None,
        *,
        session: NvshmemSession | None = None,
        timeout_s: float | None = None,
    ) -> NvshmemComm:
        """Allocate the symmetric buffers (collective) and resolve every peer's address.

        Args:
            ctx: rank, world_size, device (cuda), timeout_s.
            session: a shared `NvshmemSession` (default: a new one this communicator owns).
            timeout_s: device wait bound (default ZERODRAM_EP_DEVICE_TIMEOUT_S, else ctx.timeout_s).

        Raises:
            ConfigError: layout/context mismatch, no GPU, a layout of other rows than bf16, or a
                peer that no peer pointer reaches.
        """
        from zerodram.runtime.comm import check_layout_matches, resolve_backend
        from zerodram.runtime.envs import ENVS

        check_layout_matches(layout, ctx)
        resolve_backend(ctx, "nvshmem", layout.dtype)  # a GPU, and bf16 rows (what the kernels move)
        timeout_s = timeout_s or ENVS.EP_DEVICE_TIMEOUT_S.get() or ctx.timeout_s
        owned = session is None
        if session is None:
            session = NvshmemSession.create(ctx, heap_bytes=heap_bytes(layout))
        return cls(layout, router, session, owned, float(timeout_s))

    def __init__(
        self,
        layout: EpLayout,
        router: RouterConfig | None,
        session: NvshmemSession,
        owned: bool,
        timeout_s: float,
    ) -> None:
        self.layout, self.router, self.session = layout, router, session
        self._owns_session, self.timeout_s, self._closed = owned, timeout_s, False
        lay, dev = layout, session.device
        W, El, Elm = lay.world_size, lay.num_local_experts, lay.placement.max_local_experts
        self.sym = SymmetricLayout.of(lay)
        phases = 1 if session.one_phase else 2
        cap, D = lay.recv_capacity, lay.hidden
        i32 = {"dtype": torch.int32, "device": dev}

        def recv_buffers() -> dict[str, torch.Tensor]:  # what a dispatch returns views of
            return {
                "x": torch.empty(cap, D, dtype=torch.bfloat16, device=dev),
                "src_rank": torch.empty(cap, **i32),
                "src_idx": torch.empty(cap, **i32),
                "counts": torch.zeros(El, W, **i32),
                "pair_offsets": torch.zeros(El, W, **i32),
                "expert_offsets": torch.zeros(El, **i32),
                "num_per_expert": torch.zeros(El, **i32),
                "num_rows": torch.zeros(1, **i32),
                "topk_idx": torch.empty(lay.max_tokens_per_rank, lay.top_k, dtype=torch.int64, device=dev),
                "topk_weight": torch.empty(lay.max_tokens_per_rank, lay.top_k, dtype=torch.float32, device=dev),
            }

        if session.one_phase:  # one set for every communicator of this shape (module docstring)
            # the symmetric buffer's key is global (the same on every rank: its allocation is
            # collective); the receive tensors are this rank's own
            self.buffer = session.shared(("symmetric", self.sym), lambda: session.alloc_bytes(self.sym.phase_bytes))
            recv_key = ("receive", self.sym, cap, D, El, lay.max_tokens_per_rank, lay.top_k)
            self._recv = session.shared(recv_key, lambda: [recv_buffers()])
        else:
            self.buffer = session.alloc_bytes(2 * self.sym.phase_bytes)
            self._recv = [recv_buffers() for _ in range(2)]
        session.barrier()  # every PE's flags are zero before anyone may write them
        bases = [session.peer_address(self.buffer, r) for r in range(W)]
        unreachable = [r for r, b in enumerate(bases) if b is None]
        if unreachable:
            self.close()
            raise ConfigError(
                f"rank {lay.rank}: ranks {unreachable} are not reachable through peer pointers "
                "(other node?); their put-with-signal path (kernels/cuda/dispatch_remote.cu) needs the "
                "NVSHMEM device library linked into NVRTC modules, which this build cannot do: use the "
                "torch backend across nodes"
            )
        self.peer_base = torch.tensor(
            [[b + p * self.sym.phase_bytes for b in bases] for p in range(phases)], dtype=torch.int64, device=dev
        )  # [phases, W]
        self.my_base = [self.buffer.data_ptr() + p * self.sym.phase_bytes for p in range(phases)]
        owner_rank, owner_local, num_owners = (t.to(dev) for t in lay.placement.owner_tables())
        ring = lay.placement.ring_peers
        ring_pos = [0] * W
        for s, r in enumerate(ring):
            ring_pos[r] = s
        self.args = SendArgs(
            owner_rank, owner_local, num_owners,
            torch.tensor(ring_pos, **i32), torch.tensor(ring, **i32),
            torch.tensor([len(lay.placement.local_experts(r)) for r in range(W)], **i32),
            W, lay.rank, Elm, lay.max_tokens_per_rank, lay.msg_bytes, lay.wire == "fp8",
            self.sym.off_msg, self.sym.off_info, self.sym.off_flag,
        )  # fmt: skip
        self.send_counter = torch.zeros(W * Elm, **i32)
        self.done_send = torch.zeros(1, **i32)
        self.done_combine = torch.zeros(1, **i32)
        self.error = torch.zeros(4, dtype=torch.int64, device=dev)
        self.expert_load = torch.zeros(El, dtype=torch.int64, device=dev)
        self._phase = 0
        self._pinned = session.one_phase
        self.kernels = DispatchKernels()

    def pin_phase(self) -> None:
        """Use phase 0 for every call from now on, for an owner that makes one dispatch and its
        combine per step, in that order (the engine: once per layer and step). One phase is then
        enough: a rank's dispatch of step k + 1 starts after its combine of step k, which waited
        for every peer's combine send of step k, which each peer issued after packing its step-k
        rows; likewise a combine send of step k + 1 follows the dispatch wait of k + 1, which
        follows every peer's combine reduce of step k. That second chain needs the sender to have
        waited on dispatch flags, i.e. to host an expert: a rank without experts could set a
        peer's combine flag of k + 1 before the peer zeroed that of k. So `ExpertParallelWorld`
        pins (and makes a one-phase session) only where every rank hosts an expert; with two
        alternating phases the chain runs through the call in between. And a CUDA graph bakes the
        phase it was captured with: pinned, replays and eager calls agree on every rank."""
        self._phase, self._pinned = 0, True

    @property
    def phase_pinned(self) -> bool:
        return self._pinned

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def _dispatch(self, x: torch.Tensor, rin: RouteInput) -> DispatchOutput:
        lay, a = self.layout, self.args
        if not x.is_cuda:  # its dtype and shape: `dispatch` checked them against the (bf16) layout
            raise ConfigError(f"NVSHMEM dispatch takes CUDA rows, got rows on {x.device}")
        phase = self._phase
        if not self._pinned:
            self._phase ^= 1
        T, K, dev = x.shape[0], lay.top_k, x.device
        x = x.contiguous()
        logits = None
        if not rin.needs_router:
            mode = ROUTE_TOPK
            topk_idx = rin.topk_idx.to(device=dev, dtype=torch.int64).contiguous()
            topk_weight = rin.topk_weight.to(device=dev, dtype=torch.float32).contiguous()
        else:
            # the fused router's outputs: per-phase buffers, valid as long as this phase's recv_x
            topk_idx, topk_weight = self._recv[phase]["topk_idx"][:T], self._recv[phase]["topk_weight"][:T]
            mode = ROUTE_LOGITS
            if rin.logits is not None:
                logits = rin.logits.float().contiguous()
            else:  # one GEMM over every SM; the send kernel then takes each token's top-k
                logits = gate_logits(x, rin.gate_weight.to(torch.bfloat16))
        router = self.router or RouterConfig(lay.num_experts, K)
        r = self._recv[phase]
        self.kernels.send(
            a, x, topk_idx, topk_weight, mode, router.scoring_id, router.renormalize, lay.num_experts,
            self.peer_base[phase], self.send_counter, self.done_send, logits=logits,
        )  # fmt: skip
        self.kernels.wait(
            self.my_base[phase], self.sym.off_flag, lay.world_size, lay.num_local_experts,
            r["counts"], r["pair_offsets"], r["expert_offsets"], r["num_per_expert"], self.expert_load,
            r["num_rows"], self.timeout_ns, self.error,
        )  # fmt: skip
        self.kernels.pack(
            self.my_base[phase], a, lay.hidden, lay.num_local_experts, r["counts"], r["pair_offsets"],
            r["x"], r["src_rank"], r["src_idx"],
        )  # fmt: skip
        return DispatchOutput(
            r["x"], r["expert_offsets"], r["num_per_expert"], topk_idx, topk_weight, _Handle(phase, T)
        )

    def _combine(self, expert_out: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        lay, h = self.layout, dispatched.handle
        r = self._recv[h.phase]
        y = expert_out.contiguous()  # bf16 [N, D]: `combine` checked it against the layout
        self.kernels.combine_send(
            y, r["src_rank"], r["src_idx"], r["num_rows"], self.peer_base[h.phase], self.sym.off_comb,
            self.sym.off_comb_flag, lay.world_size, lay.rank, self.args.ring_peers, self.done_combine,
        )  # fmt: skip
        self.kernels.combine_wait(
            self.my_base[h.phase], self.sym.off_comb_flag, lay.world_size, self.timeout_ns, self.error
        )
        # a fresh tensor, not a per-phase buffer: the caller owns y (a residual may outlive a phase)
        out = torch.empty(h.T, lay.hidden, dtype=torch.bfloat16, device=y.device)
        self.kernels.combine_reduce(
            self.my_base[h.phase], self.sym.off_comb, dispatched.topk_idx, dispatched.topk_weight, out
        )
        return out

    def check(self) -> None:
        """Raise `RankTimeoutError` naming the silent rank (and expert) if a device wait expired."""
        err = self.error.tolist()  # host sync: call between steps, not inside one
        if not err[0]:
            return
        kind, src, le = err[1], err[2], err[3]
        lay = self.layout
        if kind == 99:
            raise ConfigError("dispatch_remote.cu was built without ZD_WITH_NVSHMEM")
        what = "dispatch rows" if kind == 1 else "combine rows"
        expert = f" for expert {lay.local_experts[le]}" if 0 <= le < lay.num_local_experts else ""
        raise RankTimeoutError(
            f"rank {lay.rank}/{lay.world_size} waited {self.timeout_s:g}s on the device for {what}{expert} "
            f"from rank {src}"
        )

    def close(self) -> None:
        """Free the symmetric buffer (collective) and, if owned, finalize NVSHMEM. Idempotent."""
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.session.device)
        self.session.barrier()
        if not self.session.one_phase:  # a shared buffer lives as long as the session
            self.session.free(self.buffer)
        if self._owns_session:
            self.session.close()


def heap_bytes(lay: EpLayout, num_comms: int = 1, one_phase: bool = False) -> int:
    """Symmetric heap to ask for: both phases of `num_comms` communicators of this layout, or the
    one phase they all share on a `one_phase` session, plus slack for NVSHMEM's own allocations."""
    return (1 if one_phase else num_comms * 2) * SymmetricLayout.of(lay).phase_bytes + (256 << 20)
