"""The topology loader on valid input: shipped files, the public API, ring and placement properties.

Bad input (every error names file:line:column) is in test_topology_errors.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerodram.launch.cli import main
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.format import DEFAULT_FP2
from zerodram.runtime.topology import (
    RankSpec,
    Topology,
    derive_ring,
    is_derangement,
    load_topology,
    packaged_topologies,
    resolve_topology_path,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "topologies").glob("*.yaml"))
EXPECTED = {"local-cpu-4", "h200-1", "h200-1x4pe", "hgx-h100-8", "hgx-h100-2x8", "pcie-4"}


def _load(name: str) -> Topology:
    return load_topology(resolve_topology_path(name))


def _write(tmp_path: Path, text: str, name: str = "t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- shipped files ---------------------------------------------------------------------------


def test_every_expected_file_ships() -> None:
    assert {p.stem for p in SHIPPED} >= EXPECTED
    assert set(packaged_topologies()) >= EXPECTED


def test_topo_check_accepts_every_shipped_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "check", *(str(p) for p in SHIPPED)]) == 0
    out = capsys.readouterr().out
    for path in SHIPPED:
        assert f"ok: {path} (" in out


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_ring_steps_are_permutations(path: Path) -> None:
    topo = load_topology(path)
    world = topo.world_size
    assert len(topo.ring.steps) == world
    assert topo.ring.steps[0] == tuple(range(world))
    for step in topo.ring.steps[1:]:
        assert is_derangement(step)
    for rank in range(world):
        peers = topo.ring.peers(rank)
        assert peers[0] == rank
        assert sorted(peers) == list(range(world))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_placement_covers_every_expert(path: Path) -> None:
    topo = load_topology(path)
    layout = topo.experts
    hosted = sorted(e for rank in range(topo.world_size) for e in layout.primary_experts(rank))
    assert hosted == list(range(layout.num_experts))
    for e in range(layout.num_experts):
        assert layout.owners(e)[0] == layout.expert_to_rank[e]
        for rank in layout.owners(e):
            assert e in layout.local_experts(rank)
    for rank in range(topo.world_size):
        assert list(layout.local_experts(rank)) == sorted(layout.local_experts(rank))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_topo_show_names_every_rank(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "show", str(path)]) == 0
    out = capsys.readouterr().out
    topo = load_topology(path)
    for rank in range(topo.world_size):
        assert f"rank {rank} (local {topo.rank_spec(rank).local_rank}" in out
    assert "row = step, column = source rank" in out


def test_topo_show_by_packaged_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "show", "hgx-h100-2x8"]) == 0
    out = capsys.readouterr().out
    assert "nic mlx5_7: 400 Gb/s, rail 7" in out
    assert "rank 15 (local 7)" in out
    assert "experts: 256, contiguous, wire bf16" in out


# -- resolving names -------------------------------------------------------------------------


def test_resolve_packaged_name_and_path(tmp_path: Path) -> None:
    by_name = resolve_topology_path("local-cpu-4")
    assert by_name.name == "local-cpu-4.yaml" and by_name.is_file()
    assert resolve_topology_path("local-cpu-4.yaml") == by_name
    own = _write(tmp_path, "x: 1\n")
    assert resolve_topology_path(own) == own


def test_resolve_missing_lists_packaged_names() -> None:
    with pytest.raises(ConfigError, match=r"no packaged topology .*local-cpu-4"):
        resolve_topology_path("no-such-cluster")


# -- the public API --------------------------------------------------------------------------


def test_local_cpu_4() -> None:
    topo = _load("local-cpu-4")
    assert topo.name == "local-cpu-4"
    assert topo.source.name == "local-cpu-4.yaml"
    assert (topo.world_size, topo.num_nodes, topo.ranks_per_node) == (4, 1, 4)
    assert topo.device_kind == "cpu"
    assert (topo.master_addr, topo.master_port) == ("127.0.0.1", 29500)
    assert topo.rank_spec(2) == RankSpec(2, 0, "localhost", "127.0.0.1", 2, None, None, None, None)
    assert topo.experts.num_experts == 32
    assert topo.experts.local_experts(1) == tuple(range(8, 16))
    assert topo.experts.owners(9) == (1,)
    assert (topo.kv.policy, topo.kv.format, topo.kv.page_size) == ("owner", DEFAULT_FP2, 32)
    assert topo.experts.wire == "bf16"
    assert topo.link_class(0, 1) == "SHM"
    assert topo.link_bandwidth_gbps(0, 3) == 80


def test_hgx_2x8_ranks_nics_and_bandwidth() -> None:
    topo = _load("hgx-h100-2x8")
    assert (topo.world_size, topo.num_nodes, topo.ranks_per_node) == (16, 2, 8)
    spec = topo.rank_spec(9)
    assert (spec.node_idx, spec.node_name, spec.local_rank, spec.gpu_idx) == (1, "hgx-1", 1, 1)
    assert (spec.nic_name, spec.rail, spec.nvlink_domain, spec.numa_node) == ("mlx5_1", 1, "hgx-1", 0)
    assert topo.master_addr == "hgx-0"
    assert topo.link_class(0, 7) == "NV18"
    assert topo.link_bandwidth_gbps(0, 7) == 3600  # 450 GB/s NVLink4
    assert topo.link_class(0, 8) == "NET"
    assert topo.link_bandwidth_gbps(0, 8) == 400  # one ConnectX-7
    assert topo.experts.local_experts(15) == tuple(range(240, 256))
    with pytest.raises(ValueError, match="rank 16 outside"):
        topo.rank_spec(16)


def test_hgx_2x8_worked_example_from_the_docs() -> None:
    """docs/topology.md, "Ring order": rank 3 on 2 nodes x 8."""
    topo = _load("hgx-h100-2x8")
    assert topo.ring.peers(3) == (3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10)
    assert topo.ring.peers(12) == (12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3)
    # Steps 1..7 stay on the node; step 8, the first inter-node step, keeps every rank on its rail.
    for s in range(1, 8):
        assert all(topo.link_class(src, dst) == "NV18" for src, dst in enumerate(topo.ring.steps[s]))
    for src, dst in enumerate(topo.ring.steps[8]):
        assert topo.rank_spec(src).rail == topo.rank_spec(dst).rail
        assert topo.rank_spec(src).node_idx != topo.rank_spec(dst).node_idx


def test_four_ranks_on_one_h200() -> None:
    topo = _load("h200-1x4pe")
    assert topo.world_size == 4 and topo.ranks_per_gpu == 4
    assert {r.gpu_idx for r in topo.ranks} == {0}
    assert [r.local_rank for r in topo.ranks] == [0, 1, 2, 3]
    assert topo.link_class(0, 3) == "X"
    assert topo.link_bandwidth_gbps(0, 3) == 38400  # HBM, not NVLink
    assert topo.experts.local_experts(1) == tuple(range(1, 32, 4))  # round_robin


def test_single_h200() -> None:
    topo = _load("h200-1")
    assert topo.world_size == 1 and topo.ring.steps == ((0,),)
    assert topo.experts.local_experts(0) == tuple(range(32))


def test_pcie_link_classes() -> None:
    topo = _load("pcie-4")
    assert topo.link_class(0, 1) == "PXB"  # same socket, through a PCIe switch
    assert topo.link_class(0, 2) == "SYS"  # across sockets
    assert topo.link_bandwidth_gbps(1, 2) == 256


def test_topology_is_frozen() -> None:
    topo = _load("local-cpu-4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.kv.page_size = 32  # type: ignore[misc]


def test_topology_code_imports_no_torch() -> None:
    code = "import sys, zerodram.runtime.topology, zerodram.launch.topo_cmd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# -- optional features -----------------------------------------------------------------------

CPU_HEAD = """\
cluster: t
device: cpu
fabric:
  intra_node: {kind: shm, gbps: 80}
nodes:
  - name: a
    cpu_ranks: 4
"""


def test_explicit_map_with_replicas(tmp_path: Path) -> None:
    text = CPU_HEAD + (
        "experts:\n"
        "  num_experts: 6\n"
        "  placement: explicit\n"
        "  map: {0: [5, 0], 1: [1], 2: [2, 3], 3: [4]}\n"
        "  replicas: {0: [3, 2]}\n"
    )
    topo = load_topology(_write(tmp_path, text))
    assert topo.experts.expert_to_rank == (0, 1, 2, 2, 3, 0)
    assert topo.experts.owners(0) == (0, 3, 2)
    assert topo.experts.local_experts(3) == (0, 4)
    assert topo.experts.primary_experts(3) == (4,)
    assert topo.experts.num_replicas == 2


def test_allow_uneven_contiguous(tmp_path: Path) -> None:
    text = CPU_HEAD + "experts: {num_experts: 10, allow_uneven: true}\n"
    topo = load_topology(_write(tmp_path, text))
    assert [len(topo.experts.local_experts(r)) for r in range(4)] == [3, 3, 2, 2]


def test_explicit_ring(tmp_path: Path) -> None:
    # A valid non-default order: every rank visits its peers backwards.
    text = CPU_HEAD + (
        "experts: {num_experts: 4}\n"
        "ring:\n"
        "  order: explicit\n"
        "  peers: [[0, 3, 2, 1], [1, 0, 3, 2], [2, 1, 0, 3], [3, 2, 1, 0]]\n"
    )
    topo = load_topology(_write(tmp_path, text))
    assert topo.ring.order == "explicit"
    assert topo.ring.steps[1] == (3, 0, 1, 2)
    assert topo.ring.peers(2) == (2, 1, 0, 3)


def test_rendezvous_kv_and_wire_overrides(tmp_path: Path) -> None:
    text = CPU_HEAD + (
        "experts: {num_experts: 4, wire: fp8}\n"
        "rendezvous: {master_addr: 10.0.0.9, master_port: 31000}\n"
        "kv: {format: bf16, page_size: 64}\n"
    )
    topo = load_topology(_write(tmp_path, text))
    assert (topo.master_addr, topo.master_port) == ("10.0.0.9", 31000)
    assert (topo.kv.policy, topo.kv.format, topo.kv.page_size) == ("owner", "bf16", 64)
    assert topo.experts.wire == "fp8" and topo.summary().endswith(", EP wire fp8")


def test_bounds_and_torch_pages_are_accepted(tmp_path: Path) -> None:
    # The most experts a file may give; fp32 pages are plain torch pages of any size (the paged
    # caches' multiple of 32 is theirs only).
    text = CPU_HEAD + "experts: {num_experts: 65536}\nkv: {format: fp32, page_size: 1}\n"
    topo = load_topology(_write(tmp_path, text))
    assert topo.experts.num_experts == 65536 and len(topo.experts.local_experts(3)) == 16384
    assert (topo.kv.format, topo.kv.page_size) == ("fp32", 1)


def test_default_master_addr_is_first_host(tmp_path: Path) -> None:
    text = CPU_HEAD.replace("cpu_ranks: 4", "host: box-1\n    cpu_ranks: 4") + "experts: {num_experts: 4}\n"
    topo = load_topology(_write(tmp_path, text))
    assert (topo.master_addr, topo.master_port) == ("box-1", 29500)


# -- random clusters -------------------------------------------------------------------------


def _cluster_yaml(num_nodes: int, num_gpus: int, ranks_per_gpu: int) -> str:
    lines = [
        "cluster: random",
        "device: cuda",
        f"ranks_per_gpu: {ranks_per_gpu}",
        "fabric:",
        "  intra_node: {kind: nvswitch, gbps: 3600}",
        "  inter_node: {kind: roce, rails: 8}",
        "nodes:",
    ]
    for n in range(num_nodes):
        lines += [f"  - name: n{n}", "    gpus:"]
        for g in range(num_gpus):
            lines.append(f"      - {{idx: {g}, nic: {{name: mlx5_{g}, gbps: 200, rail: {g}}}}}")
    world = num_nodes * num_gpus * ranks_per_gpu
    lines.append(f"experts: {{num_experts: {2 * world}, placement: round_robin}}")
    return "\n".join(lines) + "\n"


@settings(max_examples=60, deadline=None)
@given(
    num_nodes=st.integers(1, 4),
    num_gpus=st.integers(1, 8),
    ranks_per_gpu=st.integers(1, 4),
)
def test_random_clusters_give_derangement_steps(
    tmp_path_factory: pytest.TempPathFactory, num_nodes: int, num_gpus: int, ranks_per_gpu: int
) -> None:
    path = tmp_path_factory.mktemp("rand") / "c.yaml"
    path.write_text(_cluster_yaml(num_nodes, num_gpus, ranks_per_gpu))
    topo = load_topology(path)
    world = num_nodes * num_gpus * ranks_per_gpu
    assert topo.world_size == world and topo.ranks_per_node == num_gpus * ranks_per_gpu
    steps = topo.ring.steps
    assert steps[0] == tuple(range(world))
    for step in steps[1:]:
        assert is_derangement(step)
    # Same-node peers come first: the first ranks_per_node steps never leave the node.
    L = topo.ranks_per_node
    for s in range(L):
        assert all(topo.rank_spec(src).node_idx == topo.rank_spec(dst).node_idx for src, dst in enumerate(steps[s]))
    for rank in range(world):
        assert sorted(topo.ring.peers(rank)) == list(range(world))


@given(num_nodes=st.integers(1, 6), ranks_per_node=st.integers(1, 12))
def test_derive_ring_rule(num_nodes: int, ranks_per_node: int) -> None:
    ring = derive_ring(num_nodes, ranks_per_node)
    world = num_nodes * ranks_per_node
    for s, step in enumerate(ring.steps):
        assert is_derangement(step) or s == 0
        for src in range(world):
            # Each rank starts one past itself: step 1 on the node is the next local rank.
            j, k = divmod(s, ranks_per_node)
            n, l = divmod(src, ranks_per_node)
            assert step[src] == ((n + j) % num_nodes) * ranks_per_node + (l + k) % ranks_per_node
