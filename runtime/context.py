"""The rank context: who this process is, on which device, talking over which process group.

Built once per process from torchrun's environment (or the test launcher's, which mimics it) plus
the topology, and closed explicitly. Backends are chosen here, once:

    device     cuda:<gpu_idx> when the topology's ranks sit on GPUs and one is visible, else cpu
    backend    nccl when every rank has a GPU of its own; gloo otherwise (CPU ranks, or several
               ranks sharing one GPU, which NCCL refuses)
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from zerodram.runtime.envs import ENVS
from zerodram.runtime.errors import ConfigError, RankTimeoutError, WorldMismatchError

if TYPE_CHECKING:
    import torch

    from zerodram.runtime.topology import Topology


@dataclass(frozen=True)
class TorchrunEnv:
    """The variables torchrun sets for each worker, parsed and checked once."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> TorchrunEnv:
        missing = [
            v.name
            for v in (ENVS.RANK, ENVS.WORLD_SIZE, ENVS.MASTER_ADDR, ENVS.MASTER_PORT)
            if v.get() is None
        ]
        if missing:
            raise ConfigError(
                f"not started by torchrun: {', '.join(missing)} unset "
                "(run through `zerodram launch --topology FILE -- JOB`)"
            )
        world_size = ENVS.WORLD_SIZE.require()
        env = cls(
            rank=ENVS.RANK.require(),
            local_rank=ENVS.LOCAL_RANK.get() or 0,
            world_size=world_size,
            local_world_size=ENVS.LOCAL_WORLD_SIZE.get() or world_size,
            node_rank=ENVS.GROUP_RANK.get() or 0,
            master_addr=ENVS.MASTER_ADDR.require(),
            master_port=ENVS.MASTER_PORT.require(),
        )
        if not 0 <= env.rank < env.world_size:
            raise ConfigError(f"RANK={env.rank} outside WORLD_SIZE={env.world_size}")
        if not 0 <= env.local_rank < env.local_world_size:
            raise ConfigError(f"LOCAL_RANK={env.local_rank} outside LOCAL_WORLD_SIZE={env.local_world_size}")
        return env


def check_world(topology: Topology, env: TorchrunEnv) -> None:
    """Raise `WorldMismatchError` naming both numbers when torchrun and the topology disagree."""
    src = topology.source.name
    if env.world_size != topology.world_size:
        raise WorldMismatchError(
            f"topology {src} has {topology.world_size} ranks, torchrun started {env.world_size}"
        )
    if env.local_world_size != topology.ranks_per_node:
        raise WorldMismatchError(
            f"topology {src} has {topology.ranks_per_node} ranks per node, "
            f"torchrun started {env.local_world_size} on this node"
        )
    spec = topology.rank_spec(env.rank)
    if spec.node_idx != env.node_rank or spec.local_rank != env.local_rank:
        raise WorldMismatchError(
            f"topology {src} puts rank {env.rank} on node {spec.node_idx} as local rank "
            f"{spec.local_rank}, torchrun started it on node {env.node_rank} as local rank "
            f"{env.local_rank}"
        )


def local_device(device: str | None = None) -> str:
    """"cuda" or "cpu" for a job of this one process: `device` as given ("auto" or None: a GPU
    when one is visible, unless ZERODRAM_FORCE_CPU). Raises ConfigError for cuda without a GPU."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() and not ENVS.FORCE_CPU.get() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda: this machine has no CUDA device")
    return device


def one_process_context(device: str | None = None) -> SimpleNamespace | None:
    """The rank context of a job of this one process without a process group (all experts local):
    None on the CPU, else rank 0 of 1 on the current GPU (`local_device` picks)."""
    if local_device(device) == "cpu":
        return None
    from zerodram.runtime.device import canonical_device

    return SimpleNamespace(device=canonical_device("cuda"), rank=0, world_size=1, local_rank=0, topology=None)


class RankContext:
    """One process's place in the job. Create with `RankContext.create()`, end with `close()`.

    Attributes:
        rank, world_size, local_rank, node_rank: as torchrun numbered them.
        device: the torch device this rank computes on.
        backend: the torch.distributed backend of `group` ("gloo" or "nccl").
        topology: the loaded topology, or None for ad-hoc runs (tests).
        timeout_s: the bound on every host-side cross-rank wait.
    """

    def __init__(
        self,
        env: TorchrunEnv,
        device: torch.device,
        backend: str,
        topology: Topology | None,
        timeout_s: float,
    ) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.node_rank = env.node_rank
        self.device = device
        self.backend = backend
        self.topology = topology
        self.timeout_s = timeout_s
        self._closed = False
        self._cpu_group = None

    @classmethod
    def create(
        cls, topology: Topology | None = None, *, device: str | None = None, timeout_s: float | None = None
    ) -> RankContext:
        """Initialise torch.distributed for this process.

        Args:
            topology: checked against torchrun's world (sizes and placement) when given.
            device: "cpu" or "cuda" to override the topology's choice.
            timeout_s: bound on host-side collectives (default ZERODRAM_WAIT_TIMEOUT_S).

        Raises:
            WorldMismatchError: torchrun's world differs from the topology's.
            ConfigError: the topology wants GPUs and none is visible, not under torchrun, or a
                variable of torchrun's or a ZERODRAM_ timeout out of range.
            RankTimeoutError: the rendezvous failed (a rank never joined, or no rank 0 to reach).
        """
        import torch
        import torch.distributed as dist

        env = TorchrunEnv.from_environ()
        if topology is not None:
            check_world(topology, env)
        timeout_s = float(timeout_s if timeout_s is not None else ENVS.WAIT_TIMEOUT_S.get())
        want = device or (topology.device_kind if topology is not None else "cpu")
        if ENVS.FORCE_CPU.get():
            want = "cpu"
        if want == "cuda":
            if not torch.cuda.is_available():
                name = topology.source.name if topology is not None else "the job"
                raise ConfigError(f"{name} places ranks on GPUs but this machine has no CUDA device")
            gpu = env.local_rank
            if topology is not None and topology.rank_spec(env.rank).gpu_idx is not None:
                gpu = topology.rank_spec(env.rank).gpu_idx
            dev = torch.device("cuda", gpu)
            torch.cuda.set_device(dev)
            shared_gpu = (
                topology is not None
                and len({r.gpu_idx for r in topology.ranks if r.node_idx == env.node_rank})
                < topology.ranks_per_node
            )
            backend = "gloo" if shared_gpu else "nccl"
        else:
            dev = torch.device("cpu")
            backend = "gloo"
        if not dist.is_initialized():
            address, t0 = f"tcp://{env.master_addr}:{env.master_port}", time.monotonic()
            try:
                dist.init_process_group(
                    backend=backend,
                    init_method=address,
                    rank=env.rank,
                    world_size=env.world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
            except (dist.DistStoreError, dist.DistNetworkError) as err:
                # store: rank 0 waited for ranks that never joined; network: no rank 0 to reach
                # (or its port is taken, which fails at once: hence the elapsed time, not the limit)
                raise RankTimeoutError(
                    f"rank {env.rank}/{env.world_size}: rendezvous at {address} failed after "
                    f"{time.monotonic() - t0:.1f}s (limit {timeout_s:g}s): {_first_line(err)}"
                ) from err
        return cls(env, dev, backend, topology, timeout_s)

    @classmethod
    def single_process(cls, device: str | None = None, timeout_s: float | None = None) -> RankContext:
        """This process as a one-rank world (benchmarks run outside torchrun): a process group on a
        free loopback port, `device` "cuda" (GPU 0) or "cpu" (default: cuda when visible, unless
        ZERODRAM_FORCE_CPU). Close it like any context."""
        import socket

        import torch
        import torch.distributed as dist

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = TorchrunEnv(0, 0, 1, 1, 0, "127.0.0.1", port)
        timeout_s = float(timeout_s if timeout_s is not None else ENVS.WAIT_TIMEOUT_S.get())
        dev = torch.device("cuda", 0) if local_device(device) == "cuda" else torch.device("cpu")
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return cls(env, dev, backend, None, timeout_s)

    @property
    def cpu_group(self):
        """A gloo process group over every rank, for host-side control and bounded barriers: the
        default group on gloo, a second group beside NCCL (made collectively at first use, which
        every rank reaches at the same point of the program)."""
        import torch.distributed as dist

        if self.backend != "nccl":
            return None  # the default group
        if self._cpu_group is None:
            self._cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._cpu_group

    def barrier(self, what: str) -> None:
        """A bounded barrier; on expiry raises `RankTimeoutError` naming rank and purpose (gloo's
        monitored barrier, on `cpu_group` beside NCCL, whose own barrier has no bound)."""
        import torch.distributed as dist

        t0 = time.monotonic()
        try:
            dist.monitored_barrier(group=self.cpu_group, timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            # not always the limit: a peer that crashed fails the barrier at once
            raise RankTimeoutError(
                f"rank {self.rank}/{self.world_size}: barrier '{what}' failed after "
                f"{time.monotonic() - t0:.1f}s (limit {self.timeout_s:g}s): {_first_line(err)}"
            ) from err

    def all_gather_object(self, payload: object, what: str) -> list:
        """Every rank's `payload`, in rank order, through the bounded CPU group; on failure or expiry
        raises `RankTimeoutError` naming rank and purpose, as `barrier` does."""
        import torch.distributed as dist

        out: list = [None] * self.world_size
        t0 = time.monotonic()
        try:
            dist.all_gather_object(out, payload, group=self.cpu_group)
        except RuntimeError as err:
            raise RankTimeoutError(
                f"rank {self.rank}/{self.world_size}: exchanging {what} failed after "
                f"{time.monotonic() - t0:.1f}s (limit {self.timeout_s:g}s): {_first_line(err)}"
            ) from err
        return out

    def close(self) -> None:
        """Tear down the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> RankContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RankContext(rank={self.rank}/{self.world_size}, node={self.node_rank}, "
            f"device={self.device}, backend={self.backend})"
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
