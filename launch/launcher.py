"""`zerodram launch`: derive torchrun's arguments from a topology and exec torchrun.

    zerodram launch --topology topologies/hgx-h100-2x8.yaml --node-rank 0 -- smoke

prints the command every other node must run, then replaces this process with torchrun
(`--dry-run` only prints). Rendezvous is static (`--master-addr/--master-port` from the topology,
`--node-rank` from the flag), so the same command with another `--node-rank` starts each node.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from zerodram.launch.worker import check_job
from zerodram.runtime.errors import ConfigError


@dataclass(frozen=True)
class LaunchPlan:
    """Everything torchrun needs, derived from the topology."""

    num_nodes: int
    ranks_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    topology_path: str
    job: tuple[str, ...]

    def torchrun_argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "zerodram.launch.torchrun",  # torchrun, with a one-line failure report
            f"--nnodes={self.num_nodes}",
            f"--nproc-per-node={self.ranks_per_node}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            "-m",
            "zerodram.launch.worker",
            *self.job,
        ]

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """torchrun's environment: `base` plus the topology for the workers, and two defaults."""
        # PYTHONSAFEPATH: `python -m` would put the working directory first on every worker's
        # sys.path; run from a source checkout, our `kernels/` folder would then shadow the PyPI
        # `kernels` package that transformers imports. zerodram comes from its install, not the cwd.
        env = dict(base, ZERODRAM_TOPOLOGY=self.topology_path, PYTHONSAFEPATH="1")
        # torchrun's own default for several ranks a node, set here so that it does not print a
        # five-line warning about setting it; a value the user set stays
        if self.ranks_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def command_for_node(self, node_rank: int) -> str:
        return shlex.join(
            [
                "zerodram",
                "launch",
                "--topology",
                self.topology_path,
                "--node-rank",
                str(node_rank),
                "--master-port",
                str(self.master_port),
                "--",
                *self.job,
            ]
        )


def plan_launch(topology_arg: str, node_rank: int, master_port: int | None, job: list[str]) -> LaunchPlan:
    """Load the topology and build the plan. Raises ConfigError on bad input."""
    from zerodram.runtime.topology import load_topology, resolve_topology_path

    path = resolve_topology_path(topology_arg)
    topo = load_topology(path)
    if not 0 <= node_rank < topo.num_nodes:
        raise ConfigError(
            f"--node-rank {node_rank} is outside the topology's {topo.num_nodes} node(s)",
            path=str(path),
        )
    if master_port is not None and not 1 <= master_port <= 65535:
        raise ConfigError(f"--master-port {master_port} is not a TCP port (expected 1..65535)")
    if not job:
        raise ConfigError("no job given: zerodram launch --topology FILE -- JOB [ARGS]")
    return LaunchPlan(
        num_nodes=topo.num_nodes,
        ranks_per_node=topo.ranks_per_node,
        node_rank=node_rank,
        master_addr=topo.master_addr,
        master_port=master_port if master_port is not None else topo.master_port,
        topology_path=str(path),
        job=tuple(job),
    )


def _cmd(args: argparse.Namespace) -> int:
    job = list(args.job)
    if job and job[0] == "--":
        job = job[1:]
    plan = plan_launch(args.topology, args.node_rank, args.master_port, job)
    check_job(plan.job[0], list(plan.job[1:]), plan.node_rank)
    argv = plan.torchrun_argv()
    for other in range(plan.num_nodes):
        if other != plan.node_rank:
            print(f"node {other}: {plan.command_for_node(other)}", file=sys.stderr)
    print(f"node {plan.node_rank}: {shlex.join(argv)}", file=sys.stderr)
    if args.dry_run:
        return 0
    env = plan.environment(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
    return 0  # not reached


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start a job on this node's ranks through torchrun, sized by a topology",
        description="Derive torchrun's arguments from a topology, print the other nodes' "
        "commands, and exec torchrun. Jobs: see `zerodram worker --help`.",
    )
    p.add_argument("--topology", required=True, help="topology file or packaged name")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-port", type=int, default=None, help="override the topology's port")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    p.add_argument("job", nargs=argparse.REMAINDER, help="-- JOB [ARGS]")
    p.set_defaults(func=_cmd)
