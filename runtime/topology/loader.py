"""Topology YAML -> frozen dataclasses, once, with every error at file:line:column.

The file is composed (`yaml.compose`), not loaded, so each value keeps its position; sections
are read into the dataclasses of `schema`, and any `ConfigError` raised by their invariants is
located through the positions the reader recorded. The reference of every key is
docs/topology.md.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

import yaml
from yaml.nodes import Node, ScalarNode

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.topology.checks import NVLINK_KINDS, check_cluster
from zerodram.runtime.topology.placement import EP_WIRES, PLACEMENTS, ExpertLayout, build_layout
from zerodram.runtime.topology.reader import Entry, Reader, join
from zerodram.runtime.topology.ring import RING_ORDERS, RingSchedule, derive_ring
from zerodram.runtime.topology.schema import (
    DEFAULT_MASTER_PORT,
    DEVICE_KINDS,
    INTER_NODE_KINDS,
    INTRA_NODE_KINDS,
    KV_POLICIES,
    PCI_CLASSES,
    Fabric,
    GpuSpec,
    InterNodeFabric,
    IntraNodeFabric,
    KvSpec,
    NicSpec,
    NodeSpec,
    Topology,
    enumerate_ranks,
)

TOP_KEYS = (
    "cluster",
    "device",
    "gpu_model",
    "ranks_per_gpu",
    "rendezvous",
    "fabric",
    "nodes",
    "experts",
    "kv",
    "ring",
)
TOP_REQUIRED = ("cluster", "device", "fabric", "nodes", "experts")


def packaged_topologies() -> tuple[str, ...]:
    """Names of the topology files shipped in `zerodram.topologies` ("local-cpu-4", ...)."""
    root = files("zerodram.topologies")
    return tuple(sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml")))


def resolve_topology_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A topology argument -> the file to load.

    An existing file wins; otherwise a bare name ("local-cpu-4" or "local-cpu-4.yaml") names a
    packaged topology. Raises ConfigError (listing the packaged names) when neither exists.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.exists():
        raise ConfigError(f"topology '{name_or_path}' is not a file")
    if len(path.parts) == 1:
        packaged = files("zerodram.topologies") / f"{path.name.removesuffix('.yaml')}.yaml"
        if packaged.is_file():
            # Installed (editable or wheel) packages are plain directories: the path is real.
            return Path(str(packaged))
    raise ConfigError(
        f"no topology file '{name_or_path}' and no packaged topology of that name "
        f"(packaged: {', '.join(packaged_topologies())})"
    )


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read, validate and freeze one topology file.

    Raises:
        ConfigError: naming the file, line, column and field, and what was expected: unreadable
            or empty file, YAML syntax error, wrong type, unknown key (closest known key
            suggested), or a violated invariant (see docs/topology.md, "Validation").
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("no such file", path=str(path)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the file: {err}", path=str(path)) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "invalid YAML"
        raise ConfigError(
            f"YAML syntax error: {problem}",
            path=str(path),
            line=mark.line + 1 if mark else None,
            column=mark.column + 1 if mark else None,
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"YAML error: {err}", path=str(path), line=1, column=1) from None
    if root is None or (isinstance(root, ScalarNode) and root.tag.endswith(":null")):
        raise ConfigError(
            f"the file is empty; expected a topology mapping with keys {', '.join(TOP_REQUIRED)}",
            path=str(path),
            line=1,
            column=1,
        )
    reader = Reader(path)
    try:
        return _topology(reader, root)
    except ConfigError as err:
        raise reader.locate(err) from None


def _topology(r: Reader, root: Node) -> Topology:
    top = r.mapping(root, "", TOP_KEYS, TOP_REQUIRED)
    device = r.str_(top["device"].value, "device", choices=DEVICE_KINDS)
    ranks_per_gpu = 1
    if "ranks_per_gpu" in top:
        ranks_per_gpu = r.int_(top["ranks_per_gpu"].value, "ranks_per_gpu", minimum=1)
        if device == "cpu" and ranks_per_gpu != 1:
            raise r.error(
                top["ranks_per_gpu"].key,
                "ranks_per_gpu",
                "device cpu has no GPUs; use the nodes' 'cpu_ranks'",
            )
    fabric = _fabric(r, top["fabric"].value)
    node_items = r.sequence(top["nodes"].value, "nodes", non_empty=True)
    nodes = tuple(_node(r, n, join("nodes", i), fabric.intra_node.kind) for i, n in enumerate(node_items))
    ranks = enumerate_ranks(nodes, ranks_per_gpu)
    # Before the ring: the derivation rule needs the same number of ranks on every node.
    check_cluster(device, nodes, fabric, ranks)
    world, ranks_per_node = len(ranks), len(ranks) // len(nodes)
    addr, port = _rendezvous(r, top.get("rendezvous"), nodes[0].host)
    return Topology(
        name=r.str_(top["cluster"].value, "cluster"),
        source=r.path,
        device_kind=device,
        nodes=nodes,
        fabric=fabric,
        ranks=ranks,
        ranks_per_gpu=ranks_per_gpu,
        experts=_experts(r, top["experts"].value, world),
        ring=_ring(r, top.get("ring"), len(nodes), ranks_per_node, world),
        kv=_kv(r, top.get("kv")),
        master_addr=addr,
        master_port=port,
        gpu_model=_opt_str(r, top, "gpu_model", ""),
    )


def _fabric(r: Reader, node: Node) -> Fabric:
    sec = r.mapping(node, "fabric", ("intra_node", "inter_node"), ("intra_node",))
    f = "fabric.intra_node"
    intra = r.mapping(
        sec["intra_node"].value,
        f,
        ("kind", "gbps", "nvlinks", "pcie_gbps", "pci_class", "same_gpu_gbps"),
        ("kind", "gbps"),
    )
    kind = r.str_(intra["kind"].value, join(f, "kind"), choices=INTRA_NODE_KINDS)
    if "nvlinks" in intra and kind not in NVLINK_KINDS:
        raise r.error(
            intra["nvlinks"].key, join(f, "nvlinks"), f"'nvlinks' needs an NVLink kind, not '{kind}'"
        )
    if "pcie_gbps" in intra and kind != "nvlink_mesh":
        raise r.error(
            intra["pcie_gbps"].key, join(f, "pcie_gbps"), "'pcie_gbps' is only read with kind nvlink_mesh"
        )
    if "pci_class" in intra and kind != "pcie":
        raise r.error(intra["pci_class"].key, join(f, "pci_class"), "'pci_class' is only read with kind pcie")
    intra_fabric = IntraNodeFabric(
        kind=kind,
        gbps=r.number(intra["gbps"].value, join(f, "gbps")),
        nvlinks=_opt_int(r, intra, "nvlinks", f, minimum=1),
        pcie_gbps=_opt_number(r, intra, "pcie_gbps", f),
        pci_class=r.str_(intra["pci_class"].value, join(f, "pci_class"), choices=PCI_CLASSES)
        if "pci_class" in intra
        else "PHB",
        same_gpu_gbps=_opt_number(r, intra, "same_gpu_gbps", f),
    )
    inter_fabric = None
    if "inter_node" in sec:
        f = "fabric.inter_node"
        inter = r.mapping(sec["inter_node"].value, f, ("kind", "rails", "gbps"), ("kind",))
        inter_fabric = InterNodeFabric(
            kind=r.str_(inter["kind"].value, join(f, "kind"), choices=INTER_NODE_KINDS),
            rails=_opt_int(r, inter, "rails", f, minimum=1),
            gbps=_opt_number(r, inter, "gbps", f),
        )
    return Fabric(intra_fabric, inter_fabric)


def _node(r: Reader, node: Node, f: str, intra_kind: str) -> NodeSpec:
    sec = r.mapping(node, f, ("name", "host", "gpus", "cpu_ranks"), ("name",))
    name = r.str_(sec["name"].value, join(f, "name"))
    if ("gpus" in sec) == ("cpu_ranks" in sec):
        raise r.error(node, f, "a node gives exactly one of 'gpus' (a list of GPUs) or 'cpu_ranks' (a count)")
    if "cpu_ranks" in sec:
        cpu_ranks = r.int_(sec["cpu_ranks"].value, join(f, "cpu_ranks"), minimum=1)
        return NodeSpec(name, _opt_str(r, sec, "host", f) or name, (), cpu_ranks)
    items = r.sequence(sec["gpus"].value, join(f, "gpus"), non_empty=True)
    gf = join(f, "gpus")
    # NVLink kinds join a node's GPUs into one domain unless the file splits them (nvlink_mesh).
    default_domain = name if intra_kind in NVLINK_KINDS else None
    gpus = tuple(_gpu(r, g, join(gf, i), default_domain) for i, g in enumerate(items))
    return NodeSpec(name, _opt_str(r, sec, "host", f) or name, gpus, None)


def _gpu(r: Reader, node: Node, f: str, default_domain: str | None) -> GpuSpec:
    sec = r.mapping(node, f, ("idx", "nvlink_domain", "nic", "numa_node", "pci"), ("idx",))
    nic = None
    if "nic" in sec:
        nf = join(f, "nic")
        n = r.mapping(sec["nic"].value, nf, ("name", "gbps", "rail", "pci"), ("name", "gbps"))
        nic = NicSpec(
            name=r.str_(n["name"].value, join(nf, "name")),
            gbps=r.number(n["gbps"].value, join(nf, "gbps")),
            rail=_opt_int(r, n, "rail", nf, minimum=0),
            pci=_opt_str(r, n, "pci", nf),
        )
    return GpuSpec(
        idx=r.int_(sec["idx"].value, join(f, "idx"), minimum=0),
        nvlink_domain=_opt_str(r, sec, "nvlink_domain", f) or default_domain,
        nic=nic,
        numa_node=_opt_int(r, sec, "numa_node", f, minimum=0),
        pci=_opt_str(r, sec, "pci", f),
    )


def _experts(r: Reader, node: Node, world: int) -> ExpertLayout:
    f = "experts"
    sec = r.mapping(
        node, f, ("num_experts", "placement", "allow_uneven", "map", "replicas", "wire"), ("num_experts",)
    )
    num_experts = r.int_(sec["num_experts"].value, join(f, "num_experts"), minimum=1)
    placement = "contiguous"
    if "placement" in sec:
        placement = r.str_(sec["placement"].value, join(f, "placement"), choices=PLACEMENTS)
    explicit_map = None
    if "map" in sec:
        mf = join(f, "map")
        explicit_map = {
            rank: tuple(r.int_list(v, join(mf, rank), what="an expert index"))
            for rank, v in r.int_keyed(sec["map"].value, mf, "rank")
        }
    replicas = None
    if "replicas" in sec:
        rf = join(f, "replicas")
        replicas = {
            e: tuple(r.int_list(v, join(rf, e), what="a rank"))
            for e, v in r.int_keyed(sec["replicas"].value, rf, "expert index")
        }
    allow_uneven = False
    if "allow_uneven" in sec:
        if placement == "explicit":
            raise r.error(
                sec["allow_uneven"].key,
                join(f, "allow_uneven"),
                "'allow_uneven' is only read with placement contiguous or round_robin",
            )
        allow_uneven = r.bool_(sec["allow_uneven"].value, join(f, "allow_uneven"))
    wire = r.str_(sec["wire"].value, join(f, "wire"), choices=EP_WIRES) if "wire" in sec else "bf16"
    return build_layout(
        num_experts,
        world,
        placement,
        allow_uneven=allow_uneven,
        explicit_map=explicit_map,
        replicas=replicas,
        wire=wire,
    )


def _ring(r: Reader, entry: Entry | None, num_nodes: int, ranks_per_node: int, world: int) -> RingSchedule:
    if entry is None:
        return derive_ring(num_nodes, ranks_per_node)
    sec = r.mapping(entry.value, "ring", ("order", "peers"))
    order = r.str_(sec["order"].value, "ring.order", choices=RING_ORDERS) if "order" in sec else "derived"
    if order == "derived":
        if "peers" in sec:
            raise r.error(sec["peers"].key, "ring.peers", "'peers' is only read with order 'explicit'")
        return derive_ring(num_nodes, ranks_per_node)
    if "peers" not in sec:
        raise r.error(entry.value, "ring.peers", "order 'explicit' needs 'peers': one visit order per rank")
    rows = r.sequence(sec["peers"].value, "ring.peers")
    if len(rows) != world:
        raise r.error(
            sec["peers"].value,
            "ring.peers",
            f"lists {len(rows)} visit orders; expected one per rank ({world})",
        )
    peers = tuple(tuple(r.int_list(row, join("ring.peers", i), what="a rank")) for i, row in enumerate(rows))
    return RingSchedule.from_peers("explicit", peers)


def _kv(r: Reader, entry: Entry | None) -> KvSpec:
    if entry is None:
        return KvSpec()
    sec = r.mapping(entry.value, "kv", ("policy", "format", "page_size"))
    default = KvSpec()
    return KvSpec(
        policy=r.str_(sec["policy"].value, "kv.policy", choices=KV_POLICIES)
        if "policy" in sec
        else default.policy,
        format=r.str_(sec["format"].value, "kv.format")  # checked by KvSpec, located by the loader
        if "format" in sec
        else default.format,
        page_size=r.int_(sec["page_size"].value, "kv.page_size", minimum=1)
        if "page_size" in sec
        else default.page_size,
    )


def _rendezvous(r: Reader, entry: Entry | None, first_host: str) -> tuple[str, int]:
    if entry is None:
        return first_host, DEFAULT_MASTER_PORT
    sec = r.mapping(entry.value, "rendezvous", ("master_addr", "master_port"))
    port = DEFAULT_MASTER_PORT
    if "master_port" in sec:
        port = r.int_(sec["master_port"].value, "rendezvous.master_port", minimum=1)
        if port > 65535:
            raise r.error(
                sec["master_port"].value, "rendezvous.master_port", f"expected a port <= 65535, got {port}"
            )
    return _opt_str(r, sec, "master_addr", "rendezvous") or first_host, port


def _opt_str(r: Reader, sec: dict[str, Entry], key: str, f: str) -> str | None:
    return r.str_(sec[key].value, join(f, key)) if key in sec else None


def _opt_int(r: Reader, sec: dict[str, Entry], key: str, f: str, *, minimum: int) -> int | None:
    return r.int_(sec[key].value, join(f, key), minimum=minimum) if key in sec else None


def _opt_number(r: Reader, sec: dict[str, Entry], key: str, f: str) -> float | None:
    return r.number(sec[key].value, join(f, key)) if key in sec else None
