"""`zerodram topo check FILE...` and `zerodram topo show FILE`.

FILE is a path or a packaged name ("local-cpu-4"). `check` validates every file it is given and
reports each bad one (exit 2) rather than stopping at the first; `show` renders one with rich.
"""

from __future__ import annotations

import argparse
import sys

from zerodram.runtime.errors import ConfigError


def _check(args: argparse.Namespace) -> int:
    from zerodram.runtime.topology import load_topology, resolve_topology_path

    bad = 0
    for arg in args.files:
        try:
            topo = load_topology(resolve_topology_path(arg))
        except ConfigError as err:
            bad += 1
            print(f"zerodram: error: {err}", file=sys.stderr)
            continue
        print(f"ok: {arg} ({topo.summary()})")
    if bad and len(args.files) > 1:
        print(f"zerodram: {bad} of {len(args.files)} topology files are invalid", file=sys.stderr)
    return ConfigError.exit_code if bad else 0


def _show(args: argparse.Namespace) -> int:
    from rich.console import Console

    from zerodram.runtime.topology import load_topology, resolve_topology_path
    from zerodram.runtime.topology.render import show, wide_enough

    topo = load_topology(resolve_topology_path(args.file))
    # A terminal keeps its own width; a pipe or a captured stream gets one wide enough for the
    # ring matrix, so cells never wrap into unreadable columns.
    console = Console(file=sys.stdout)
    if not console.is_terminal:
        console = Console(file=sys.stdout, width=wide_enough(topo))
    show(topo, console)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "topo",
        help="check or show topology files",
        description="Validate topology files or render one (nodes, GPUs, ranks, experts, ring). "
        "FILE is a path or a packaged name such as local-cpu-4. Reference: docs/topology.md.",
    )
    topo_sub = p.add_subparsers(dest="topo_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])

    check = topo_sub.add_parser(
        "check",
        help="validate topology files (exit 2 naming file:line:column on the first error of each)",
        description="Load every FILE; print 'ok: FILE (...)' for each good one and the error of each "
        "bad one on stderr. Exit 0 when all are valid, 2 otherwise.",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="topology file or packaged name")
    check.set_defaults(func=_check)

    show_p = topo_sub.add_parser(
        "show",
        help="render a topology: hardware tree, expert placement, ring schedule",
        description="Render FILE: a tree of nodes -> GPUs -> ranks and NICs, the expert placement "
        "(rank -> experts, replicas marked *), and the ring as a step x source-rank matrix.",
    )
    show_p.add_argument("file", metavar="FILE", help="topology file or packaged name")
    show_p.set_defaults(func=_show)
