"""Hardware invariants of a topology, checked once at load.

They span sections (nodes vs fabric vs device), so they live apart from the dataclasses; they
run before the ring is derived (the rule needs uniform nodes) and again in
`Topology.__post_init__`. Errors carry the YAML field; the loader adds file, line and column.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodram.runtime.errors import ConfigError

if TYPE_CHECKING:
    from zerodram.runtime.topology.schema import Fabric, NodeSpec, RankSpec

NVLINK_KINDS = ("nvswitch", "nvlink_mesh")


def check_cluster(
    device_kind: str, nodes: tuple[NodeSpec, ...], fabric: Fabric, ranks: tuple[RankSpec, ...]
) -> None:
    """The hardware invariants, checked before a ring is derived (it needs uniform nodes).

    Raises:
        ConfigError: (field set) duplicate node names or GPU indices, non-uniform ranks per node,
            a fabric kind that does not fit the device, bad NVLink domains or rails, a multi-node
            cluster without an inter-node fabric or NIC bandwidth.
    """
    _check_nodes(device_kind, nodes, ranks)
    _check_fabric(device_kind, nodes, fabric, ranks)


def _check_nodes(device_kind: str, nodes: tuple[NodeSpec, ...], ranks: tuple[RankSpec, ...]) -> None:
    if not nodes:
        raise ConfigError("expected at least one node", field="nodes")
    names: dict[str, int] = {}
    counts: list[int] = []
    for i, node in enumerate(nodes):
        if node.name in names:
            raise ConfigError(
                f"duplicate node name '{node.name}' (also nodes[{names[node.name]}])",
                field=f"nodes[{i}].name",
            )
        names[node.name] = i
        if device_kind == "cpu" and node.cpu_ranks is None:
            raise ConfigError("device cpu: give the node 'cpu_ranks', not 'gpus'", field=f"nodes[{i}]")
        if device_kind == "cuda" and node.cpu_ranks is not None:
            raise ConfigError(
                "device cuda: list the node's 'gpus', not 'cpu_ranks'", field=f"nodes[{i}].cpu_ranks"
            )
        seen: dict[int, int] = {}
        for j, gpu in enumerate(node.gpus):
            if gpu.idx in seen:
                raise ConfigError(
                    f"duplicate GPU index {gpu.idx} on node '{node.name}' (also gpus[{seen[gpu.idx]}])",
                    field=f"nodes[{i}].gpus[{j}].idx",
                )
            seen[gpu.idx] = j
        counts.append(sum(1 for r in ranks if r.node_idx == i))
        if counts[i] != counts[0]:
            raise ConfigError(
                f"node '{node.name}' has {counts[i]} ranks but node '{nodes[0].name}' has "
                f"{counts[0]}; every node must run the same number of ranks (torchrun takes one "
                "--nproc-per-node)",
                field=f"nodes[{i}]",
            )


def _check_fabric(
    device_kind: str, nodes: tuple[NodeSpec, ...], fabric: Fabric, ranks: tuple[RankSpec, ...]
) -> None:
    intra, inter = fabric.intra_node, fabric.inter_node
    if (intra.kind == "shm") != (device_kind == "cpu"):
        want = "shm" if device_kind == "cpu" else "nvswitch, nvlink_mesh or pcie"
        raise ConfigError(
            f"device {device_kind} needs intra-node kind {want}, got '{intra.kind}'",
            field="fabric.intra_node.kind",
        )
    domain_node: dict[str, int] = {}
    for i, node in enumerate(nodes):
        domains = {g.nvlink_domain for g in node.gpus}
        for j, gpu in enumerate(node.gpus):
            where = f"nodes[{i}].gpus[{j}]"
            if gpu.nvlink_domain is not None and intra.kind not in NVLINK_KINDS:
                raise ConfigError(
                    f"intra-node kind '{intra.kind}' has no NVLink; drop 'nvlink_domain'",
                    field=f"{where}.nvlink_domain",
                )
            if gpu.nvlink_domain is not None and domain_node.setdefault(gpu.nvlink_domain, i) != i:
                raise ConfigError(
                    f"NVLink domain '{gpu.nvlink_domain}' spans nodes {domain_node[gpu.nvlink_domain]} "
                    f"and {i}; multi-node NVLink domains are not supported",
                    field=f"{where}.nvlink_domain",
                )
            if inter is not None and inter.rails is not None and gpu.nic is not None:
                rail = gpu.nic.rail
                if rail is not None and rail >= inter.rails:
                    raise ConfigError(
                        f"rail {rail} outside the fabric's {inter.rails} rails (0..{inter.rails - 1})",
                        field=f"{where}.nic.rail",
                    )
        if intra.kind == "nvswitch" and len(domains) > 1:
            raise ConfigError(
                f"an NVSwitch crossbar joins every GPU of a node, but node '{node.name}' lists NVLink "
                f"domains {', '.join(sorted(str(d) for d in domains))}",
                field=f"nodes[{i}].gpus",
            )
        if intra.kind == "nvlink_mesh" and len(domains) > 1 and intra.pcie_gbps is None:
            raise ConfigError(
                f"node '{node.name}' has GPUs in different NVLink domains; give 'pcie_gbps' for the "
                "PCIe path between them",
                field="fabric.intra_node",
            )
    if len(nodes) > 1:
        if inter is None:
            raise ConfigError(f"{len(nodes)} nodes need 'fabric.inter_node'", field="fabric")
        for r in ranks:
            if r.nic_gbps is None and inter.gbps is None:
                raise ConfigError(
                    f"rank {r.rank} (node '{r.node_name}') has no NIC; give its GPU a 'nic' or set "
                    "'fabric.inter_node.gbps'",
                    field="fabric.inter_node",
                )
