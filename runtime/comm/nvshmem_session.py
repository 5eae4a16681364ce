"""NVSHMEM for one process: UID bootstrap under torchrun, symmetric allocations, finalize.

    session = NvshmemSession.create(ctx)        # collective: every rank
    buf = session.alloc_bytes(n)                # collective, same n everywhere
    addr = session.peer_address(buf, pe)        # None: no peer pointer reaches pe (other node)
    session.free(buf); session.close()          # close is idempotent; frees what is left

Rank 0 makes the unique id; its bytes travel through torch.distributed (gloo works, also for
several PEs on one GPU, which NCCL refuses). In NVSHMEM's one-GPU multi-PE mode only
`barrier_all` / `sync_all` work (team barriers abort), so this module uses nothing else.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zerodram.runtime.errors import ConfigError


class _StreamRef:
    """torch stream -> the `__cuda_stream__` protocol nvshmem4py expects."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._handle = stream.cuda_stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


class NvshmemSession:
    """NVSHMEM initialised for this process. Build with `create`; end with `close()`."""

    def __init__(self, rank: int, world_size: int, device: torch.device, one_phase: bool = False) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.one_phase = one_phase
        self._buffers: list[torch.Tensor] = []
        self._shared: dict[Any, Any] = {}
        self._closed = False

    @classmethod
    def create(cls, ctx: Any, heap_bytes: int | None = None, one_phase: bool = False) -> NvshmemSession:
        """Initialise NVSHMEM on ctx.device (collective over ctx's process group).

        Args:
            ctx: rank, world_size, device (cuda) of this process.
            heap_bytes: symmetric heap per PE (NVSHMEM_SYMMETRIC_SIZE) unless already set.
            one_phase: the owner's promise that its communicators are called in one fixed order,
                each with one dispatch and then its combine, and never two at once (the engine:
                layer by layer, step by step). They then share one phase of buffers
                (`NvshmemComm`'s docstring says why that is safe).

        Raises:
            ConfigError: nvshmem4py missing, or the device is not a GPU.
        """
        try:
            import nvshmem.core as nvshmem
            from cuda.core import Device
        except ImportError as err:
            raise ConfigError(f"NVSHMEM backend needs nvshmem4py-cu13 and cuda-core: {err}") from err
        if ctx.device.type != "cuda":
            raise ConfigError(f"NVSHMEM needs a GPU; rank {ctx.rank} runs on {ctx.device}")
        if heap_bytes:
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(int(heap_bytes)))
        torch.cuda.set_device(ctx.device)
        dev = Device(ctx.device.index)
        dev.set_current()
        uid = nvshmem.get_unique_id(empty=ctx.rank != 0)
        raw = uid._data.view(np.uint8)
        payload = torch.from_numpy(raw.copy())
        if dist.is_initialized() and ctx.world_size > 1:
            if dist.get_backend() == "nccl":
                moved = payload.to(ctx.device)
                dist.broadcast(moved, src=0)
                payload = moved.cpu()
            else:
                dist.broadcast(payload, src=0)
        if ctx.rank != 0:
            raw[:] = payload.numpy()
        nvshmem.init(device=dev, uid=uid, rank=ctx.rank, nranks=ctx.world_size, initializer_method="uid")
        return cls(ctx.rank, ctx.world_size, ctx.device, one_phase)

    def shared(self, key: Any, make: Any) -> Any:
        """The object made by `make()` the first time `key` is asked for, the same one after.
        Where `make` allocates symmetric memory (collective), the key must be the same on every
        rank, and every rank must ask in the same order."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def alloc_bytes(self, nbytes: int) -> torch.Tensor:
        """A zeroed symmetric uint8 tensor [nbytes] (collective: same size on every PE)."""
        import nvshmem.core as nvshmem

        t = nvshmem.tensor((int(nbytes),), dtype=torch.uint8)
        t.zero_()
        self._buffers.append(t)
        return t

    def peer_address(self, t: torch.Tensor, pe: int) -> int | None:
        """Address of PE `pe`'s copy of symmetric `t` as this process can store to it, or None."""
        import nvshmem.core as nvshmem

        if pe == self.rank:
            return t.data_ptr()
        try:
            peer = nvshmem.get_peer_tensor(t, pe)
        except Exception:  # nvshmem4py raises its own types when nvshmem_ptr gives NULL
            return None
        addr = 0 if peer is None else peer.data_ptr()
        return addr or None

    def barrier(self) -> None:
        """barrier_all on torch's current stream, then wait for it on the host."""
        import nvshmem.core as nvshmem

        stream = torch.cuda.current_stream(self.device)
        nvshmem.barrier_all(stream=_StreamRef(stream))
        stream.synchronize()

    def free(self, t: torch.Tensor) -> None:
        """Free a symmetric tensor (collective)."""
        import nvshmem.core as nvshmem

        for i, b in enumerate(self._buffers):
            if b is t:
                del self._buffers[i]
                nvshmem.free_tensor(t)
                return

    def close(self) -> None:
        """Free what is left and finalize NVSHMEM. Idempotent."""
        if self._closed:
            return
        self._closed = True
        import nvshmem.core as nvshmem

        torch.cuda.synchronize(self.device)
        self._shared.clear()
        for t in self._buffers:
            nvshmem.free_tensor(t)
        self._buffers.clear()
        nvshmem.finalize()
