"""Python wrappers of the dispatch/combine kernels (`kernels/cuda/dispatch.cu`, `combine.cu`).

Shape legend: T tokens, E experts, K top-k, D hidden, W world size, El local experts, Elm max
local experts, N packed-row capacity.

Each wrapper only converts arguments to the kernels' C types and picks a grid; the protocol lives
in the CUDA sources and in `runtime/comm/nvshmem_comm.py`. All launches are asynchronous on torch's
current stream, with no host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions

THREADS = 256
ROUTE_TOPK, ROUTE_LOGITS = 0, 1

# Every source these wrappers load, with the options CI compiles them with.
SOURCES: dict[str, BuildOptions] = {
    "dispatch": BuildOptions(),
    "combine": BuildOptions(),
}
REMOTE_SOURCE = "dispatch_remote"
REMOTE_OPTIONS = BuildOptions.make(
    nvshmem=True, defines={"ZD_WITH_NVSHMEM": 1, "__NVSHMEM_NUMBA_SUPPORT__": 1}
)


def _p(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _i(v: int) -> np.int32:
    return np.int32(v)


def _l(v: int) -> np.int64:
    return np.int64(v)


@dataclass(frozen=True)
class SendArgs:
    """The static part of a dispatch-send launch (device tables, sizes, buffer offsets)."""

    owner_rank: torch.Tensor  # [E, R] int32
    owner_local: torch.Tensor  # [E, R] int32
    num_owners: torch.Tensor  # [E] int32
    ring_pos: torch.Tensor  # [W] int32
    ring_peers: torch.Tensor  # [W] int32
    num_local_experts: torch.Tensor  # [W] int32
    world_size: int
    rank: int
    max_local_experts: int
    max_tokens: int
    msg_bytes: int
    wire_fp8: bool
    off_msg: int
    off_info: int
    off_flag: int


class DispatchKernels:
    """The loaded kernels of one device."""

    def __init__(self) -> None:
        from zerodram.kernels.module import load_module

        self._d = load_module("dispatch", SOURCES["dispatch"])
        self._c = load_module("combine", SOURCES["combine"])

    def send(
        self,
        a: SendArgs,
        x: torch.Tensor,  # [T, D] bf16
        topk_idx: torch.Tensor,  # [T, K] int64 (in or out)
        topk_weight: torch.Tensor,  # [T, K] fp32 (in or out)
        route_mode: int,
        scoring: int,
        renormalize: bool,
        num_experts: int,
        peer_base: torch.Tensor,  # [W] int64 addresses of this phase
        send_counter: torch.Tensor,  # [W * Elm] int32
        done_blocks: torch.Tensor,  # [1] int32
        logits: torch.Tensor | None = None,  # [T, E] fp32
    ) -> None:
        from zerodram.kernels.module import launch, num_sms

        T, D = x.shape
        grid = max(1, min(T, 2 * num_sms(x.device.index)))  # >= 1 block even at T == 0: it signals
        args = (
            _p(x), _p(logits), _p(topk_idx), _p(topk_weight),
            _i(T), _i(D), _i(num_experts), _i(topk_idx.shape[1]), _i(route_mode), _i(scoring),
            _i(int(renormalize)),
            _p(a.owner_rank), _p(a.owner_local), _p(a.num_owners), _i(a.owner_rank.shape[1]),
            _p(a.ring_pos), _p(a.ring_peers), _p(a.num_local_experts), _p(peer_base),
            _i(a.world_size), _i(a.rank), _i(a.max_local_experts), _i(a.max_tokens), _i(a.msg_bytes),
            _i(int(a.wire_fp8)), _l(a.off_msg), _l(a.off_info), _l(a.off_flag),
            _p(send_counter), _p(done_blocks),
        )  # fmt: skip
        launch(self._d.kernel("moe_dispatch_send"), (grid,), (THREADS,), args, shared_mem=4 * num_experts)

    def wait(
        self,
        my_base: int,
        off_flag: int,
        world_size: int,
        num_local_experts: int,
        recv_counts: torch.Tensor,  # [El, W] int32
        recv_pair_offsets: torch.Tensor,  # [El, W] int32
        recv_expert_offsets: torch.Tensor,  # [El] int32
        recv_num_tokens_per_expert: torch.Tensor,  # [El] int32
        expert_load: torch.Tensor,  # [El] int64
        recv_num_rows: torch.Tensor,  # [1] int32
        timeout_ns: int,
        error: torch.Tensor,  # [4] int64
    ) -> None:
        from zerodram.kernels.module import launch

        n = num_local_experts * world_size
        args = (
            np.uint64(my_base), _l(off_flag), _i(world_size), _i(num_local_experts),
            _p(recv_counts), _p(recv_pair_offsets), _p(recv_expert_offsets), _p(recv_num_tokens_per_expert),
            _p(expert_load), _p(recv_num_rows), np.uint64(timeout_ns), _p(error),
        )  # fmt: skip
        launch(
            self._d.kernel("moe_dispatch_wait"),
            (1,),
            (THREADS,),
            args,
            shared_mem=4 * (n + num_local_experts),
        )

    def pack(
        self,
        my_base: int,
        a: SendArgs,
        hidden: int,
        num_local_experts: int,
        recv_counts: torch.Tensor,
        recv_pair_offsets: torch.Tensor,
        recv_x: torch.Tensor,  # [N, D] bf16
        recv_src_rank: torch.Tensor,  # [N] int32
        recv_src_idx: torch.Tensor,  # [N] int32
    ) -> None:
        from zerodram.kernels.module import launch

        pairs = num_local_experts * a.world_size
        if pairs == 0:
            return
        args = (
            np.uint64(my_base), _l(a.off_msg), _l(a.off_info), _i(a.world_size), _i(a.max_tokens),
            _i(a.msg_bytes), _i(hidden), _i(int(a.wire_fp8)),
            _p(recv_counts), _p(recv_pair_offsets), _p(recv_x), _p(recv_src_rank), _p(recv_src_idx),
        )  # fmt: skip
        launch(self._d.kernel("moe_dispatch_pack"), (min(a.max_tokens, 16), pairs), (THREADS,), args)

    def combine_send(
        self,
        expert_out: torch.Tensor,  # [N, D] bf16
        recv_src_rank: torch.Tensor,
        recv_src_idx: torch.Tensor,
        recv_num_rows: torch.Tensor,
        peer_base: torch.Tensor,
        off_comb: int,
        off_comb_flag: int,
        world_size: int,
        rank: int,
        ring_peers: torch.Tensor,
        done_blocks: torch.Tensor,
    ) -> None:
        from zerodram.kernels.module import launch, num_sms

        N, D = expert_out.shape
        grid = max(1, min(N, 2 * num_sms(expert_out.device.index)))
        args = (
            _p(expert_out), _p(recv_src_rank), _p(recv_src_idx), _p(recv_num_rows), _p(peer_base),
            _l(off_comb), _l(off_comb_flag), _i(D), _i(world_size), _i(rank), _p(ring_peers), _p(done_blocks),
        )  # fmt: skip
        launch(self._c.kernel("moe_combine_send"), (grid,), (THREADS,), args)

    def combine_wait(
        self, my_base: int, off_comb_flag: int, world_size: int, timeout_ns: int, error: torch.Tensor
    ) -> None:
        from zerodram.kernels.module import launch

        args = (np.uint64(my_base), _l(off_comb_flag), _i(world_size), np.uint64(timeout_ns), _p(error))
        launch(self._c.kernel("moe_combine_wait"), (1,), (min(1024, max(32, world_size)),), args)

    def combine_reduce(
        self,
        my_base: int,
        off_comb: int,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        out: torch.Tensor,  # [T, D] bf16
    ) -> None:
        from zerodram.kernels.module import launch, num_sms

        T, D = out.shape
        if T == 0:
            return
        args = (
            np.uint64(my_base), _l(off_comb), _p(topk_idx), _p(topk_weight),
            _i(T), _i(topk_idx.shape[1]), _i(D), _p(out),
        )  # fmt: skip
        launch(
            self._c.kernel("moe_combine_reduce"), (min(T, 4 * num_sms(out.device.index)),), (THREADS,), args
        )
