"""The topology: the cluster zerodram runs on, loaded once from YAML into frozen dataclasses.

    topo = load_topology(resolve_topology_path("local-cpu-4"))
    topo.world_size, topo.ranks_per_node, topo.rank_spec(3).gpu_idx
    topo.experts.owners(expert_idx), topo.experts.local_experts(rank)
    topo.ring.steps[s][src_rank] -> dst_rank

Files: `schema` (dataclasses), `loader` (YAML with positions -> dataclasses), `reader` (positioned
YAML access), `checks` (hardware invariants), `placement` (experts), `ring` (dispatch order),
`render` (rich views for `zerodram topo show`). Reference: docs/topology.md.
"""

from zerodram.runtime.topology.loader import load_topology, packaged_topologies, resolve_topology_path
from zerodram.runtime.topology.placement import ExpertLayout
from zerodram.runtime.topology.ring import RingSchedule, derive_ring, is_derangement
from zerodram.runtime.topology.schema import (
    Fabric,
    GpuSpec,
    InterNodeFabric,
    IntraNodeFabric,
    KvSpec,
    NicSpec,
    NodeSpec,
    RankSpec,
    Topology,
)

__all__ = [
    "ExpertLayout",
    "Fabric",
    "GpuSpec",
    "InterNodeFabric",
    "IntraNodeFabric",
    "KvSpec",
    "NicSpec",
    "NodeSpec",
    "RankSpec",
    "RingSchedule",
    "Topology",
    "derive_ring",
    "is_derangement",
    "load_topology",
    "packaged_topologies",
    "resolve_topology_path",
]
