"""Rich views of a topology for `zerodram topo show`: hardware tree, expert placement, ring matrix.

Pure consumers of a loaded `Topology`; they render on any console, a terminal or a plain file
(tests capture the output), so nothing here depends on colour or terminal width. Every label is a
`Text`, never a markup string: names and PCI ids from the file ("0000:ab:00.0") must not be read
as rich markup or emoji codes (":ab:" would print an emoji).
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from zerodram.runtime.topology.placement import format_ranges
from zerodram.runtime.topology.schema import GpuSpec, Topology


def _t(label: str, style: str = "") -> Text:
    return Text(label, style=style)


def _gbps(value: float) -> str:
    return f"{value:g} Gb/s ({value / 8:g} GB/s)"


def hardware_tree(topo: Topology) -> Tree:
    """cluster -> nodes -> GPUs -> ranks and NICs (CPU nodes: node -> ranks)."""
    intra, inter = topo.fabric.intra_node, topo.fabric.inter_node
    root = Tree(_t(f"{topo.name}  ({topo.summary()})", "bold"))
    fabric = root.add(_t("fabric"))
    links = f", {intra.nvlinks} NVLinks per GPU" if intra.nvlinks else ""
    fabric.add(_t(f"intra-node: {intra.kind}, {_gbps(intra.gbps)} per direction{links}"))
    if intra.same_gpu_gbps is not None:
        fabric.add(_t(f"same GPU: {_gbps(intra.same_gpu_gbps)}"))
    if intra.pcie_gbps is not None:
        fabric.add(_t(f"across NVLink domains (PCIe): {_gbps(intra.pcie_gbps)}"))
    if inter is not None:
        rails = f", {inter.rails} rails" if inter.rails else ""
        bw = f", {_gbps(inter.gbps)} per rank without NIC" if inter.gbps else ""
        fabric.add(_t(f"inter-node: {inter.kind}{rails}{bw}"))
    root.add(_t(f"rendezvous: {topo.master_addr}:{topo.master_port}"))
    for node_idx, node in enumerate(topo.nodes):
        branch = root.add(_t(f"node {node_idx}: {node.name} (host {node.host})", "bold"))
        node_ranks = [r for r in topo.ranks if r.node_idx == node_idx]
        if not node.gpus:
            for r in node_ranks:
                branch.add(_t(f"rank {r.rank} (local {r.local_rank}, cpu)"))
            continue
        for gpu in node.gpus:
            gpu_branch = branch.add(_t(_gpu_label(gpu)))
            for r in node_ranks:
                if r.gpu_idx == gpu.idx:
                    gpu_branch.add(_t(f"rank {r.rank} (local {r.local_rank})"))
            if gpu.nic is not None:
                rail = f", rail {gpu.nic.rail}" if gpu.nic.rail is not None else ""
                pci = f", pci {gpu.nic.pci}" if gpu.nic.pci else ""
                gpu_branch.add(_t(f"nic {gpu.nic.name}: {gpu.nic.gbps:g} Gb/s{rail}{pci}"))
    return root


def _gpu_label(gpu: GpuSpec) -> str:
    parts = [f"gpu {gpu.idx}"]
    if gpu.nvlink_domain:
        parts.append(f"NVLink domain {gpu.nvlink_domain}")
    if gpu.numa_node is not None:
        parts.append(f"NUMA {gpu.numa_node}")
    if gpu.pci:
        parts.append(f"pci {gpu.pci}")
    return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")


def placement_title(topo: Topology) -> Text:
    layout = topo.experts
    title = f"experts: {layout.num_experts}, {layout.placement}"
    if layout.num_replicas:
        title += f", {layout.num_replicas} replicas (*)"
    return _t(title + f", wire {layout.wire}", "bold")


def placement_table(topo: Topology) -> Table:
    """rank -> experts it hosts; replicas marked with a trailing '*'."""
    layout = topo.experts
    table = Table()
    table.add_column("rank", justify="right")
    table.add_column("node")
    table.add_column("#", justify="right")
    table.add_column("experts (primary)")
    if layout.num_replicas:
        table.add_column("replicas")
    for r in topo.ranks:
        primary = layout.primary_experts(r.rank)
        row = [
            str(r.rank),
            r.node_name,
            str(len(layout.local_experts(r.rank))),
            format_ranges(primary) or "-",
        ]
        if layout.num_replicas:
            extra = [e for e in layout.local_experts(r.rank) if e not in primary]
            row.append(", ".join(f"{e}*" for e in extra) or "-")
        table.add_row(*(_t(c) for c in row))
    return table


def ring_table(topo: Topology) -> Table:
    """The schedule as a matrix: row = step, column = source rank, cell = destination rank."""
    table = Table()
    table.add_column("step", justify="right")
    for src in range(topo.world_size):
        table.add_column(f"r{src}", justify="right")
    for s, step in enumerate(topo.ring.steps):
        table.add_row(_t(str(s)), *(_t(str(dst)) for dst in step))
    return table


def show(topo: Topology, console: Console) -> None:
    """Print the tree, the placement table and the ring matrix to `console`."""
    ring_title = f"ring ({topo.ring.order}): row = step, column = source rank, cell = destination rank"
    console.print(
        Group(
            hardware_tree(topo),
            placement_title(topo),
            placement_table(topo),
            _t(ring_title, "bold"),
            ring_table(topo),
        )
    )


def wide_enough(topo: Topology) -> int:
    """A console width that fits the ring matrix without wrapping its cells (for plain files)."""
    cell = len(str(topo.world_size)) + 3
    return max(100, 8 + (cell + 1) * (topo.world_size + 1))
