"""Bad topology input: every error exits 2 and names the file, line, column and field.

One row per bad input of issue 2, plus a few more of the checks in docs/topology.md
("Validation"): the file text, the position ("line:column", 1-based as editors show it) and field
the message must name, and a fragment of what it must say. `CPU` is 7 lines long, so whatever
follows it starts on line 8.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_topology import CPU_HEAD

from zerodram.launch.cli import main
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.topology import load_topology

CPU = CPU_HEAD  # one CPU node of 4 ranks: the smallest valid topology
CPU_2_NODES = CPU.replace("  intra_node:", "  inter_node: {kind: roce, gbps: 100}\n  intra_node:")
GPU_3 = """\
cluster: t
device: cuda
fabric:
  intra_node: {kind: nvswitch, gbps: 3600}
nodes:
  - name: a
    gpus:
      - {idx: 0}
      - {idx: 1}
      - {idx: 0}
experts: {num_experts: 3}
"""
EXPERTS = "experts: {num_experts: 4}\n"
EXPLICIT = "experts:\n  num_experts: 4\n  placement: explicit\n"
PEERS = "ring:\n  order: explicit\n  peers: [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], %s]\n"
# GPU_NODE % (intra_node on line 4, extra fabric lines, the GPU list on line 7 + extra lines);
# GPU_2_NODES % (inter_node on line 5, node a's GPUs on line 8, node b's on line 10).
GPU_NODE = """\
cluster: t
device: cuda
fabric:
  intra_node: %s
%snodes:
  - name: a
    gpus: %s
experts: {num_experts: 2}
"""
NVSWITCH, TWO_GPUS, TWO_DOMAINS = (
    "{kind: nvswitch, gbps: 3600}",
    "[{idx: 0}, {idx: 1}]",
    "[{idx: 0, nvlink_domain: x}, {idx: 1, nvlink_domain: y}]",
)
GPU_2_NODES = """\
cluster: t
device: cuda
fabric:
  intra_node: {kind: nvswitch, gbps: 3600}
  inter_node: %s
nodes:
  - name: a
    gpus: [%s]
  - name: b
    gpus: [%s]
experts: {num_experts: 2}
"""

# (id, text, "line:column", field or None, fragment of the message)
# fmt: off
CASES = [
    # -- empty file, YAML syntax, shape -----------------------------------------------------
    ("empty", "", "1:1", None, "the file is empty"),
    ("only-comments", "# nothing here\n", "1:1", None, "the file is empty"),
    ("syntax", "cluster: t\ndevice: [cpu\n", "3:1", None, "YAML syntax error: expected ',' or ']'"),
    ("tab", "cluster: t\n\tdevice: cpu\n", "2:1", None, "YAML syntax error: found character '\\t'"),
    ("top-level-list", "- a\n- b\n", "1:1", None, "expected a mapping for the top level, got a list"),
    ("missing-key", CPU, "1:1", "experts", "missing required key 'experts'"),
    ("duplicate-key", CPU + EXPERTS + EXPERTS, "9:1", "experts",
     "duplicate key 'experts' (first given on line 8)"),
    # -- wrong types ------------------------------------------------------------------------
    ("str-for-int", CPU + "experts: {num_experts: many}\n", "8:24", "experts.num_experts",
     "expected an integer, got a string 'many'"),
    ("bool-for-int", CPU + "experts: {num_experts: true}\n", "8:24", "experts.num_experts",
     "expected an integer, got a boolean 'true'"),
    ("float-for-int", CPU + EXPERTS + "kv: {page_size: 1.5}\n", "9:17", "kv.page_size",
     "expected an integer, got a number '1.5'"),
    ("quoted-number", CPU.replace("gbps: 80", 'gbps: "80"') + EXPERTS, "4:33", "fabric.intra_node.gbps",
     "expected a number, got a string '80'"),
    ("unquoted-pci-id", CPU + EXPERTS + "gpu_model: 0000:18:00.0\n", "9:12", "gpu_model",
     "expected a string, got a number '0000:18:00.0' (quote it to make it a string)"),
    ("scalar-for-mapping", CPU + "experts: 4\n", "8:10", "experts",
     "expected a mapping for 'experts', got an integer '4'"),
    ("negative-bandwidth", CPU.replace("gbps: 80", "gbps: -1") + EXPERTS, "4:33", "fabric.intra_node.gbps",
     "expected a positive number, got -1"),
    ("port-too-high", CPU + EXPERTS + "rendezvous: {master_port: 70000}\n", "9:27", "rendezvous.master_port",
     "expected a port <= 65535, got 70000"),
    ("bad-choice", CPU + EXPERTS + "kv: {format: fp3}\n", "9:14", "kv.format",
     "'fp3': expected one of fp2, fp8, bf16, fp16, fp32 or fp2:OPTIONS; did you mean"),
    ("bad-fp2-option", CPU + EXPERTS + 'kv: {format: "fp2:nope=1"}\n', "9:14", "kv.format", "nope"),
    ("bad-wire", CPU + "experts: {num_experts: 4, wire: fp4}\n", "8:33", "experts.wire",
     "expected one of bf16, fp8, got 'fp4'"),
    # an explicit tag skips YAML's own pattern, so the text may not parse as the tag says
    ("bool-tag-not-a-bool", CPU + "experts: {num_experts: 4, allow_uneven: !!bool maybe}\n", "8:41",
     "experts.allow_uneven", "expected true or false, got 'maybe'"),
    ("int-tag-empty", CPU + 'experts: {num_experts: !!int ""}\n', "8:24", "experts.num_experts",
     "expected an integer, got ''"),
    ("float-tag-empty", CPU.replace("gbps: 80", 'gbps: !!float ""') + EXPERTS, "4:33", "fabric.intra_node.gbps",
     "expected a number, got ''"),
    # -- bounds -----------------------------------------------------------------------------
    ("infinite-bandwidth", CPU.replace("gbps: 80", "gbps: .inf") + EXPERTS, "4:33", "fabric.intra_node.gbps",
     "expected a finite number, got '.inf'"),
    ("nan-bandwidth", CPU.replace("gbps: 80", "gbps: .nan") + EXPERTS, "4:33", "fabric.intra_node.gbps",
     "expected a finite number, got '.nan'"),
    ("float-overflow-bandwidth", CPU.replace("gbps: 80", "gbps: 1.0e+400") + EXPERTS, "4:33",
     "fabric.intra_node.gbps", "expected a finite number, got '1.0e+400'"),
    ("int-overflow-bandwidth", CPU.replace("gbps: 80", "gbps: " + "9" * 400) + EXPERTS, "4:33",
     "fabric.intra_node.gbps", "expected a finite number, got '99999999999999999999...'"),
    ("too-many-experts", CPU + "experts: {num_experts: 4000000000}\n", "8:24", "experts.num_experts",
     "expected 1 to 65536 experts, got 4000000000"),
    ("too-many-ranks-on-a-node", CPU.replace("cpu_ranks: 4", "cpu_ranks: 100000000") + EXPERTS, "7:16",
     "nodes[0].cpu_ranks", "node 'a' brings the world size to 100000000 ranks; at most 2048 are supported"),
    ("too-many-ranks-in-all", CPU_2_NODES.replace("cpu_ranks: 4", "cpu_ranks: 1500") + "  - name: b\n"
     "    cpu_ranks: 1500\n" + EXPERTS, "10:16", "nodes[1].cpu_ranks",
     "node 'b' brings the world size to 3000 ranks; at most 2048 are supported"),
    ("too-many-ranks-per-gpu", GPU_NODE.replace("cluster: t", "cluster: t\nranks_per_gpu: 1500")
     % (NVSWITCH, "", TWO_GPUS), "8:11", "nodes[0].gpus",
     "node 'a' brings the world size to 3000 ranks; at most 2048 are supported"),
    # -- kv: what the engine's paged caches take (runtime/kv/format.py, check_paged_kv) -----
    ("kv-page-not-multiple-of-32", CPU + EXPERTS + "kv: {format: fp2, page_size: 16}\n", "9:30", "kv.page_size",
     "page size must be a positive multiple of 32, got 16"),
    ("kv-tail-not-dividing-page", CPU + EXPERTS + 'kv: {format: "fp2:tail=64", page_size: 32}\n', "9:14",
     "kv.format", "tail of 64 tokens must divide the page size 32"),
    ("kv-outliers", CPU + EXPERTS + 'kv: {format: "fp2:out=0.1"}\n', "9:14", "kv.format",
     "the paged FP2 cache does not support outliers or pre-RoPE (k)"),
    ("kv-pre-rope", CPU + EXPERTS + 'kv: {format: "fp2:kprerope=1"}\n', "9:14", "kv.format",
     "the paged FP2 cache does not support outliers or pre-RoPE (k)"),
    # -- unknown and misspelled keys --------------------------------------------------------
    ("unknown-top-key", CPU + EXPERTS + "foo: 1\n", "9:1", "foo", "unknown key 'foo' (known keys: cluster,"),
    ("misspelled-key", CPU + "experts: {num_expert: 4}\n", "8:11", "experts.num_expert",
     "unknown key 'num_expert'; did you mean 'num_experts'?"),
    ("misspelled-nested-key", CPU.replace("cpu_ranks", "cpu_rank") + EXPERTS, "7:5", "nodes[0].cpu_rank",
     "unknown key 'cpu_rank'; did you mean 'cpu_ranks'?"),
    # -- keys only read with another setting ------------------------------------------------
    ("nvlinks-with-pcie", GPU_NODE % ("{kind: pcie, gbps: 256, nvlinks: 4}", "", TWO_GPUS), "4:39",
     "fabric.intra_node.nvlinks", "'nvlinks' needs an NVLink kind, not 'pcie'"),
    ("pcie-gbps-with-nvswitch", GPU_NODE % ("{kind: nvswitch, gbps: 3600, pcie_gbps: 256}", "", TWO_GPUS), "4:44",
     "fabric.intra_node.pcie_gbps", "'pcie_gbps' is only read with kind nvlink_mesh"),
    ("pci-class-with-nvswitch", GPU_NODE % ("{kind: nvswitch, gbps: 3600, pci_class: PXB}", "", TWO_GPUS), "4:44",
     "fabric.intra_node.pci_class", "'pci_class' is only read with kind pcie"),
    ("ranks-per-gpu-on-cpu", CPU + "ranks_per_gpu: 2\n" + EXPERTS, "8:1", "ranks_per_gpu",
     "device cpu has no GPUs; use the nodes' 'cpu_ranks'"),
    # -- nodes and GPUs ---------------------------------------------------------------------
    ("duplicate-node-name", CPU_2_NODES + "  - name: a\n    cpu_ranks: 4\n" + EXPERTS, "9:11", "nodes[1].name",
     "duplicate node name 'a' (also nodes[0])"),
    ("duplicate-gpu-idx", GPU_3, "10:15", "nodes[0].gpus[2].idx", "duplicate GPU index 0 on node 'a' (also gpus[0])"),
    ("uneven-nodes", CPU_2_NODES + "  - name: b\n    cpu_ranks: 2\n" + EXPERTS, "9:5", "nodes[1]",
     "node 'b' has 2 ranks but node 'a' has 4"),
    ("two-nodes-no-inter-node", CPU + "  - name: b\n    cpu_ranks: 4\n" + EXPERTS, "4:3", "fabric",
     "2 nodes need 'fabric.inter_node'"),
    ("no-nodes", CPU.split("  - name")[0].replace("nodes:\n", "nodes: []\n") + EXPERTS, "5:8", "nodes",
     "expected a non-empty list"),
    ("gpus-and-cpu-ranks", CPU + "    gpus: [{idx: 0}]\n" + EXPERTS, "6:5", "nodes[0]",
     "a node gives exactly one of 'gpus' (a list of GPUs) or 'cpu_ranks' (a count)"),
    ("cuda-device-with-cpu-ranks", CPU.replace("device: cpu", "device: cuda").replace("shm", "nvswitch") + EXPERTS,
     "7:16", "nodes[0].cpu_ranks", "device cuda: list the node's 'gpus', not 'cpu_ranks'"),
    ("shm-with-cuda", GPU_NODE % ("{kind: shm, gbps: 80}", "", TWO_GPUS), "4:22", "fabric.intra_node.kind",
     "device cuda needs intra-node kind nvswitch, nvlink_mesh or pcie, got 'shm'"),
    ("nvlink-domain-with-pcie", GPU_NODE % ("{kind: pcie, gbps: 256}", "", "[{idx: 0, nvlink_domain: x}]"), "7:36",
     "nodes[0].gpus[0].nvlink_domain", "intra-node kind 'pcie' has no NVLink; drop 'nvlink_domain'"),
    ("nvswitch-two-domains", GPU_NODE % (NVSWITCH, "", TWO_DOMAINS), "7:11", "nodes[0].gpus",
     "an NVSwitch crossbar joins every GPU of a node, but node 'a' lists NVLink domains x, y"),
    ("mesh-without-pcie-gbps", GPU_NODE % ("{kind: nvlink_mesh, gbps: 3600}", "", TWO_DOMAINS), "4:15",
     "fabric.intra_node", "node 'a' has GPUs in different NVLink domains; give 'pcie_gbps'"),
    ("domain-spanning-nodes", GPU_2_NODES % ("{kind: infiniband, gbps: 400}", "{idx: 0, nvlink_domain: x}",
     "{idx: 0, nvlink_domain: x}"), "10:36", "nodes[1].gpus[0].nvlink_domain",
     "NVLink domain 'x' spans nodes 0 and 1; multi-node NVLink domains are not supported"),
    ("rank-without-nic", GPU_2_NODES % ("{kind: infiniband}", "{idx: 0}", "{idx: 0, nic: {name: mlx5_0, gbps: 400}}"),
     "5:15", "fabric.inter_node", "rank 0 (node 'a') has no NIC; give its GPU a 'nic' or set 'fabric.inter_node.gbps'"),
    ("rail-outside-rails", GPU_NODE % (NVSWITCH, "  inter_node: {kind: infiniband, rails: 2}\n",
     "[{idx: 0, nic: {name: mlx5_0, gbps: 400, rail: 2}}]"), "8:58", "nodes[0].gpus[0].nic.rail",
     "rail 2 outside the fabric's 2 rails (0..1)"),
    ("cpu-device-with-gpus", CPU.replace("cpu_ranks: 4", "gpus: [{idx: 0}]") + EXPERTS, "6:5", "nodes[0]",
     "device cpu: give the node 'cpu_ranks', not 'gpus'"),
    # -- expert placement -------------------------------------------------------------------
    ("map-names-missing-rank", CPU + EXPLICIT + "  map: {0: [0], 1: [1], 2: [2], 7: [3]}\n", "11:33",
     "experts.map[7]", "rank 7 does not exist (world size 4: ranks 0..3)"),
    ("replica-names-missing-rank", CPU + "experts:\n  num_experts: 4\n  replicas: {1: [9]}\n", "10:18",
     "experts.replicas[1][0]", "rank 9 does not exist (world size 4: ranks 0..3)"),
    ("map-names-missing-expert", CPU + EXPLICIT + "  map: {0: [0], 1: [1], 2: [2], 3: [3, 4]}\n", "11:40",
     "experts.map[3][1]", "expert 4 does not exist (num_experts 4: experts 0..3)"),
    ("map-key-not-a-rank", CPU + EXPLICIT + "  map: {a: [0]}\n", "11:9", "experts.map",
     "expected a rank (an integer), got a string 'a'"),
    ("map-rank-twice", CPU + EXPLICIT + "  map: {0: [0, 1], 0: [2, 3]}\n", "11:20", "experts.map[0]",
     "duplicate rank 0 (first given on line 11)"),
    ("replica-on-primary", CPU + "experts:\n  num_experts: 4\n  replicas: {1: [1]}\n", "10:18",
     "experts.replicas[1][0]", "rank 1 is already expert 1's primary owner"),
    ("replica-twice", CPU + "experts:\n  num_experts: 4\n  replicas: {1: [2, 2]}\n", "10:21",
     "experts.replicas[1][1]", "rank 2 holds a replica of expert 1 twice"),
    ("expert-unplaced", CPU + EXPLICIT + "  map: {0: [0], 1: [1], 2: [2]}\n", "11:8", "experts.map",
     "1 of 4 experts are not placed on any rank: 3"),
    ("expert-placed-twice", CPU + EXPLICIT + "  map: {0: [0, 1], 1: [1], 2: [2], 3: [3]}\n", "11:24",
     "experts.map[1][0]", "expert 1 is placed on rank 0 and again on rank 1"),
    ("explicit-without-map", CPU + "experts: {num_experts: 4, placement: explicit}\n", "8:10", "experts.map",
     "placement 'explicit' needs 'map'"),
    ("uneven-with-explicit", CPU + EXPLICIT + "  allow_uneven: true\n  map: {0: [0, 1, 2, 3]}\n", "11:3",
     "experts.allow_uneven", "'allow_uneven' is only read with placement contiguous or round_robin"),
    ("indivisible-contiguous", CPU + "experts: {num_experts: 10}\n", "8:24", "experts.num_experts",
     "10 experts do not divide evenly over 4 ranks (10 % 4 = 2)"),
    ("indivisible-round-robin", CPU + "experts: {num_experts: 6, placement: round_robin}\n", "8:24",
     "experts.num_experts", "6 experts do not divide evenly over 4 ranks (6 % 4 = 2)"),
    # -- explicit ring order ----------------------------------------------------------------
    ("ring-repeats-a-peer", CPU + EXPERTS + PEERS % "[3, 0, 1, 1]", "11:63", "ring.peers[3][3]",
     "rank 3 visits rank 1 twice (steps 2 and 3); the visit order must be a permutation of all 4 ranks"),
    ("ring-names-missing-rank", CPU + EXPERTS + PEERS % "[3, 0, 1, 5]", "11:63", "ring.peers[3][3]",
     "rank 5 does not exist (world size 4: ranks 0..3)"),
    ("ring-row-too-short", CPU + EXPERTS + PEERS % "[3, 0, 1]", "11:53", "ring.peers[3]",
     "rank 3 lists 3 peers; expected all 4 ranks, itself first"),
    ("ring-not-starting-with-self", CPU + EXPERTS + PEERS % "[0, 1, 2, 3]", "11:53", "ring.peers[3]",
     "rank 3's visit order must start with itself, got 0"),
    ("ring-step-collision", CPU + EXPERTS + PEERS % "[3, 2, 1, 0]", "11:57", "ring.peers[3][1]",
     "step 1 is not a permutation: ranks 1 and 3 both target rank 2"),
    ("ring-missing-a-rank-row", CPU + EXPERTS + PEERS.replace(", %s", ""), "11:10", "ring.peers",
     "lists 3 visit orders; expected one per rank (4)"),
    ("ring-explicit-without-peers", CPU + EXPERTS + "ring: {order: explicit}\n", "9:7", "ring.peers",
     "order 'explicit' needs 'peers'"),
    ("ring-derived-with-peers", CPU + EXPERTS + "ring: {peers: [[0]]}\n", "9:8", "ring.peers",
     "'peers' is only read with order 'explicit'"),
]
# fmt: on


@pytest.mark.parametrize(
    ("text", "position", "field", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_exits_2_naming_file_line_column_field(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    position: str,
    field: str | None,
    fragment: str,
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["topo", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    where = f"zerodram: error: {path}:{position}: " + (f"field '{field}': " if field else "")
    assert captured.err.startswith(where), captured.err
    assert fragment in captured.err, captured.err
    with pytest.raises(ConfigError) as exc:
        load_topology(path)
    line, column = map(int, position.split(":"))
    assert (exc.value.path, exc.value.line, exc.value.column, exc.value.field) == (
        str(path),
        line,
        column,
        field,
    )


def test_missing_file_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "check", "no/such/topology.yaml"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"no topology file 'no/such/topology.yaml'.*\(packaged: .*local-cpu-4", err), err


def test_unreadable_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"cluster: caf\xe9\n")
    assert main(["topo", "check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"zerodram: error: {path}: cannot read the file: ")


def test_check_reports_every_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = Path(__file__).resolve().parents[1] / "topologies" / "local-cpu-4.yaml"
    bad_a, bad_b, bad_tag = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "tag.yaml"
    bad_a.write_text("")
    bad_b.write_text(CPU + "experts: {num_experts: 10}\n")
    bad_tag.write_text(CPU + "experts: {num_experts: 4, allow_uneven: !!bool maybe}\n")
    assert main(["topo", "check", str(bad_a), str(bad_tag), str(good), str(bad_b)]) == 2
    captured = capsys.readouterr()
    assert f"ok: {good} (" in captured.out
    assert f"{bad_a}:1:1: " in captured.err and f"{bad_b}:8:24: " in captured.err
    assert f"{bad_tag}:8:41: " in captured.err
    assert "3 of 4 topology files are invalid" in captured.err
