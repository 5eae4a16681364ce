"""Communication for expert parallelism: one interface (`Communicator`), two backends.

    comm = create_communicator(ctx, layout, router, backend="auto")   # "torch" | "nvshmem"
    out = comm.dispatch(x, topk_idx=..., topk_weight=...)
    y = comm.combine(experts(out.recv_x, out.recv_expert_offsets), out)
    comm.close()

`auto` picks NVSHMEM when the context's device is a GPU and nvshmem4py imports, else torch.
"""

from __future__ import annotations

from typing import Any

from zerodram.runtime.comm.base import Communicator, DispatchOutput, RouteInput, combine_reduce
from zerodram.runtime.comm.layout import (
    EpLayout,
    ExpertPlacement,
    SendPlan,
    from_topology,
    packed_offsets,
    plan_send,
)
from zerodram.runtime.errors import ConfigError

BACKENDS = ("auto", "torch", "nvshmem")

__all__ = [
    "BACKENDS",
    "Communicator",
    "DispatchOutput",
    "EpLayout",
    "ExpertPlacement",
    "RouteInput",
    "SendPlan",
    "check_layout_matches",
    "combine_reduce",
    "create_communicator",
    "from_topology",
    "packed_offsets",
    "plan_send",
    "resolve_backend",
]


def check_layout_matches(layout: EpLayout, ctx: Any) -> None:
    """Raise `ConfigError` naming both sides when the layout and the rank context disagree."""
    if layout.world_size != ctx.world_size:
        raise ConfigError(f"EP layout spans {layout.world_size} ranks, the job has {ctx.world_size}")
    if layout.rank != ctx.rank:
        raise ConfigError(f"EP layout was built for rank {layout.rank}, this process is rank {ctx.rank}")


def resolve_backend(ctx: Any, backend: str | None = None, dtype: Any = None) -> str:
    """"torch" or "nvshmem" for `backend` ("auto", "torch", "nvshmem"; default ZERODRAM_EP_BACKEND)
    and rows of `dtype` (None: not known). NVSHMEM moves bf16 rows, so "auto" takes it only for
    bf16 (or unknown) rows on a GPU with nvshmem4py.

    Raises:
        ConfigError: unknown backend, or "nvshmem" without a GPU or for rows that are not bf16.
    """
    import torch

    from zerodram.runtime.envs import ENVS

    backend = backend or ENVS.EP_BACKEND.get()
    if backend not in BACKENDS:
        raise ConfigError(f"EP backend {backend!r}; expected one of {BACKENDS}")
    bf16 = dtype is None or dtype == torch.bfloat16
    if backend == "auto":
        backend = "nvshmem" if ctx.device.type == "cuda" and bf16 and _nvshmem_importable() else "torch"
    if backend == "nvshmem" and ctx.device.type != "cuda":
        raise ConfigError(f"EP backend nvshmem needs a GPU; rank {ctx.rank} runs on {ctx.device}")
    if backend == "nvshmem" and not bf16:
        raise ConfigError(
            f"EP backend nvshmem moves bf16 rows, this model computes in {dtype}: "
            "use bf16 weights (--dtype bf16) or the torch backend (--ep-backend torch)"
        )
    return backend


def create_communicator(
    ctx: Any, layout: EpLayout, router: Any = None, backend: str | None = None, session: Any = None
) -> Communicator:
    """Choose and build the backend once.

    Args:
        ctx: the `RankContext`.
        layout: the layer's `EpLayout`.
        router: a `RouterConfig` (needed to dispatch from logits or the gate weight).
        backend: "auto", "torch" or "nvshmem" (default: ZERODRAM_EP_BACKEND).
        session: NVSHMEM only: a shared `NvshmemSession` (the layers of one model share one; the
            session outlives them). None: the communicator creates and owns its own.

    Raises:
        ConfigError: unknown backend, "nvshmem" without a GPU or for a layout of other rows than
            bf16 ("auto" takes torch for those), or a session for the torch backend.
    """
    backend = resolve_backend(ctx, backend, layout.dtype)
    if backend == "torch":
        if session is not None:
            raise ConfigError("an NVSHMEM session was given to the torch EP backend")
        from zerodram.runtime.comm.torch_dist import TorchDistComm

        return TorchDistComm.create(ctx, layout, router)
    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm

    return NvshmemComm.create(ctx, layout, router, session=session)


def _nvshmem_importable() -> bool:
    try:
        import nvshmem.core  # noqa: F401
    except ImportError:
        return False
    return True
