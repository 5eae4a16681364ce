"""The loaded topology: frozen dataclasses, cluster -> nodes -> GPUs -> ranks, plus fabric and policies.

Built only by `loader.load_topology`; nothing past the loader sees YAML. Invariants spanning
sections (uniform ranks per node, fabric kind vs device, rails) are checked in `__post_init__`
and raised as `ConfigError` naming the YAML field; the loader adds the file, line and column.

Bandwidths are in Gb/s (gigabits per second) per direction everywhere, the unit NICs are sold in:
NVLink4's 450 GB/s per direction per GPU is 3600 Gb/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.format import DEFAULT_FP2, DEFAULT_PAGE_SIZE, check_engine_kv_format
from zerodram.runtime.topology.checks import NVLINK_KINDS, check_cluster
from zerodram.runtime.topology.placement import ExpertLayout
from zerodram.runtime.topology.ring import RingSchedule

DEVICE_KINDS = ("cpu", "cuda")
INTRA_NODE_KINDS = ("nvswitch", "nvlink_mesh", "pcie", "shm")
INTER_NODE_KINDS = ("infiniband", "roce")
# nvidia-smi topo -m classes a PCIe path between two GPUs of one NUMA node can have.
PCI_CLASSES = ("PIX", "PXB", "PHB", "NODE")
KV_POLICIES = ("owner",)
DEFAULT_MASTER_PORT = 29500
# Checked before the ranks are built: every rank loads the topology, and the ring and its checks
# are W x W in Python (derive_ring, RingSchedule): about 2 s and 200 MB per rank at 2048 ranks,
# 13 s and 750 MB at 4096. 2048 is past any expert-parallel world we run.
MAX_WORLD_SIZE = 2048


@dataclass(frozen=True)
class NicSpec:
    """A network interface a GPU sends through (NCCL topology XML: ``<nic><net name= speed=>``,
    where speed is in Mb/s; `gbps` here is Gb/s)."""

    name: str
    gbps: float
    rail: int | None = None
    pci: str | None = None


@dataclass(frozen=True)
class GpuSpec:
    """One GPU of a node. `idx` is its CUDA device index on that node."""

    idx: int
    nvlink_domain: str | None = None
    nic: NicSpec | None = None
    numa_node: int | None = None
    pci: str | None = None


@dataclass(frozen=True)
class NodeSpec:
    """One host. GPU nodes list `gpus`; CPU nodes give `cpu_ranks` instead."""

    name: str
    host: str
    gpus: tuple[GpuSpec, ...] = ()
    cpu_ranks: int | None = None


@dataclass(frozen=True)
class IntraNodeFabric:
    """How ranks of one node reach each other.

    Attributes:
        kind: nvswitch (crossbar: every GPU pair at full NVLink bandwidth), nvlink_mesh (direct
            links; pairs in different NVLink domains fall back to PCIe), pcie, or shm (CPU ranks
            through host shared memory).
        gbps: per-direction bandwidth of one GPU's NVLink / PCIe / shm path.
        nvlinks: NVLink count per GPU (nvidia-smi's NV#, NCCL's ``count``), informational.
        pcie_gbps: bandwidth between GPUs of a node that share no NVLink domain (nvlink_mesh).
        pci_class: nvidia-smi class of a same-NUMA PCIe path (PIX, PXB, PHB, NODE) for kind pcie.
        same_gpu_gbps: bandwidth between ranks sharing one GPU (its memory); default `gbps`.
    """

    kind: str
    gbps: float
    nvlinks: int | None = None
    pcie_gbps: float | None = None
    pci_class: str = "PHB"
    same_gpu_gbps: float | None = None


@dataclass(frozen=True)
class InterNodeFabric:
    """How nodes reach each other. Per-NIC bandwidth lives on each GPU's NIC; `gbps` is the
    fallback for ranks without one (CPU nodes)."""

    kind: str
    rails: int | None = None
    gbps: float | None = None


@dataclass(frozen=True)
class Fabric:
    intra_node: IntraNodeFabric
    inter_node: InterNodeFabric | None = None


@dataclass(frozen=True)
class RankSpec:
    """One rank: where it runs and what it talks through. Ranks are numbered node-major, then
    GPU in listed order, then rank within the GPU; `local_rank` is the index on its node."""

    rank: int
    node_idx: int
    node_name: str
    host: str
    local_rank: int
    gpu_idx: int | None
    nvlink_domain: str | None
    nic_name: str | None
    numa_node: int | None
    rail: int | None = None
    nic_gbps: float | None = None


@dataclass(frozen=True)
class KvSpec:
    """KV cache defaults: what the engine serves where its `--kv` / `--page-size` are not given
    (runtime/engine/jobs.py, `engine_config`). policy "owner": each rank owns the KV of its own
    requests. format: a KV page format as `--kv` takes it (`check_engine_kv_format`); page_size:
    tokens per page, which the format must take (a multiple of 32 but for fp16 / fp32 pages)."""

    policy: str = "owner"
    format: str = DEFAULT_FP2
    page_size: int = DEFAULT_PAGE_SIZE

    def __post_init__(self) -> None:
        if self.policy not in KV_POLICIES:
            raise ConfigError(
                f"expected one of {', '.join(KV_POLICIES)}, got '{self.policy}'", field="kv.policy"
            )
        if self.page_size < 1:
            raise ConfigError(f"expected a page size >= 1 token, got {self.page_size}", field="kv.page_size")
        # The engine's own check (its caches run it when built), so a pairing it would refuse at
        # start fails here, at the file's line.
        try:
            check_engine_kv_format(self.format, self.page_size)
        except ConfigError as err:
            field = "kv.page_size" if err.field == "page_size" else "kv.format"
            raise ConfigError(err.message, field=field) from None


def enumerate_ranks(nodes: tuple[NodeSpec, ...], ranks_per_gpu: int) -> tuple[RankSpec, ...]:
    """Number the ranks: node-major, GPUs in listed order, `ranks_per_gpu` consecutive ranks per GPU.

    Raises:
        ConfigError: (field ``nodes[i].cpu_ranks`` / ``nodes[i].gpus``) the nodes run more than
            MAX_WORLD_SIZE ranks; node i is the one that passes it.
    """
    num_ranks = 0
    for node_idx, node in enumerate(nodes):
        cpu = node.cpu_ranks is not None
        num_ranks += node.cpu_ranks if cpu else len(node.gpus) * ranks_per_gpu
        if num_ranks > MAX_WORLD_SIZE:
            raise ConfigError(
                f"node '{node.name}' brings the world size to {num_ranks} ranks; "
                f"at most {MAX_WORLD_SIZE} are supported",
                field=f"nodes[{node_idx}].{'cpu_ranks' if cpu else 'gpus'}",
            )
    out: list[RankSpec] = []
    for node_idx, node in enumerate(nodes):
        local = 0
        if node.cpu_ranks is not None:
            for _ in range(node.cpu_ranks):
                out.append(RankSpec(len(out), node_idx, node.name, node.host, local, None, None, None, None))
                local += 1
            continue
        for gpu in node.gpus:
            nic = gpu.nic
            for _ in range(ranks_per_gpu):
                out.append(
                    RankSpec(
                        rank=len(out),
                        node_idx=node_idx,
                        node_name=node.name,
                        host=node.host,
                        local_rank=local,
                        gpu_idx=gpu.idx,
                        nvlink_domain=gpu.nvlink_domain,
                        nic_name=nic.name if nic else None,
                        numa_node=gpu.numa_node,
                        rail=nic.rail if nic else None,
                        nic_gbps=nic.gbps if nic else None,
                    )
                )
                local += 1
    return tuple(out)


@dataclass(frozen=True)
class Topology:
    """A cluster as zerodram runs on it. Build with `load_topology`.

    Attributes:
        name: the cluster name (``cluster:`` in the file).
        source: the file it was loaded from.
        device_kind: "cpu" or "cuda".
        nodes, fabric: the hardware as described.
        ranks: every rank, index == rank.
        ranks_per_gpu: ranks sharing each GPU (1 normally; 4 to test 4 PEs on one GPU).
        experts: the expert layout; ring: the dispatch ring; kv: KV cache defaults.
        master_addr, master_port: torchrun's static rendezvous.
        gpu_model: informational ("H100-SXM").
    """

    name: str
    source: Path
    device_kind: str
    nodes: tuple[NodeSpec, ...]
    fabric: Fabric
    ranks: tuple[RankSpec, ...]
    ranks_per_gpu: int
    experts: ExpertLayout
    ring: RingSchedule
    kv: KvSpec
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT
    gpu_model: str | None = None

    def __post_init__(self) -> None:
        check_cluster(self.device_kind, self.nodes, self.fabric, self.ranks)
        world = len(self.ranks)
        if self.experts.world_size != world or self.ring.world_size != world:
            raise ConfigError(
                f"experts span {self.experts.world_size} ranks and the ring {self.ring.world_size}, "
                f"the nodes {world}",
                field="nodes",
            )

    # -- the API the runtime uses ------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on every node (uniform: checked at load, torchrun takes one --nproc-per-node)."""
        return len(self.ranks) // len(self.nodes)

    def rank_spec(self, rank: int) -> RankSpec:
        """The `RankSpec` of `rank`. Raises ValueError outside 0..world_size-1."""
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank} outside topology {self.name} (world size {self.world_size})")
        return self.ranks[rank]

    def link_class(self, src_rank: int, dst_rank: int) -> str:
        """The path between two ranks in nvidia-smi topo -m words.

        "X" same GPU (or same rank), "NV#" NVLink, "PIX"/"PXB"/"PHB"/"NODE" PCIe within a NUMA
        node, "SYS" PCIe across NUMA nodes, "SHM" host shared memory (CPU ranks), "NET" another node.
        """
        a, b = self.rank_spec(src_rank), self.rank_spec(dst_rank)
        intra = self.fabric.intra_node
        if a.node_idx != b.node_idx:
            return "NET"
        if a.rank == b.rank or (a.gpu_idx is not None and a.gpu_idx == b.gpu_idx):
            return "X"
        if intra.kind == "shm":
            return "SHM"
        if a.nvlink_domain is not None and a.nvlink_domain == b.nvlink_domain:
            return f"NV{intra.nvlinks or ''}"
        if a.numa_node is not None and b.numa_node is not None and a.numa_node != b.numa_node:
            return "SYS"
        return intra.pci_class

    def link_bandwidth_gbps(self, src_rank: int, dst_rank: int) -> float:
        """Per-direction bandwidth in Gb/s of the path between two ranks (benchmark byte floors).

        Same GPU: `same_gpu_gbps`; same node: the intra-node fabric (PCIe fallback across NVLink
        domains); other node: the slower of the two NICs (or `inter_node.gbps` without NICs).
        """
        a, b = self.rank_spec(src_rank), self.rank_spec(dst_rank)
        intra = self.fabric.intra_node
        if a.node_idx != b.node_idx:
            inter = self.fabric.inter_node
            assert inter is not None  # checked at load for every multi-node topology
            return min(x.nic_gbps if x.nic_gbps is not None else inter.gbps for x in (a, b))
        cls = self.link_class(src_rank, dst_rank)
        if cls == "X":
            return intra.same_gpu_gbps if intra.same_gpu_gbps is not None else intra.gbps
        if intra.kind in NVLINK_KINDS and not cls.startswith("NV"):
            assert intra.pcie_gbps is not None  # checked at load when NVLink domains differ
            return intra.pcie_gbps
        return intra.gbps

    def summary(self) -> str:
        """One line for `topo check`: "16 ranks, 2 nodes x 8, cuda, nvswitch + infiniband, ..."."""
        fabric = self.fabric.intra_node.kind
        if self.num_nodes > 1 and self.fabric.inter_node is not None:
            fabric += f" + {self.fabric.inter_node.kind}"
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''} x {self.ranks_per_node}"
        share = f", {self.ranks_per_gpu} ranks per GPU" if self.ranks_per_gpu > 1 else ""
        reps = f" (+{self.experts.num_replicas} replicas)" if self.experts.num_replicas else ""
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (
            f"{ranks}, {nodes}, {self.device_kind}{share}, "
            f"{fabric}, {self.experts.num_experts} experts {self.experts.placement}{reps}, "
            f"ring {self.ring.order}, kv {self.kv.format}/{self.kv.page_size}"
            + (f", EP wire {self.experts.wire}" if self.experts.wire != "bf16" else "")
        )
