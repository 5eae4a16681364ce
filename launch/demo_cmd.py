"""`zerodram demo`: the README's main job: the packaged SmolLM2 served as experts on local ranks.

    zerodram demo                       # local-cpu-4: four CPU ranks via torchrun
    zerodram demo -- --max-tokens 24 --no-dashboard
is `zerodram launch --topology local-cpu-4 -- demo ...`.
"""

from __future__ import annotations

import argparse


def _cmd(args: argparse.Namespace) -> int:
    from zerodram.launch import launcher

    rest = list(args.job_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    ns = argparse.Namespace(
        topology=args.topology,
        node_rank=0,
        master_port=args.master_port,
        dry_run=args.dry_run,
        job=["demo", *rest],
    )
    return launcher._cmd(ns)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="serve the packaged SmolLM2 as experts on the local topology's ranks, with the dashboard",
        description="Spawn the topology's ranks (torchrun), load the packaged SmolLM2-135M-Instruct "
        "sliced into experts, generate answers to a few prompts with the FP2 KV cache, show metrics.",
    )
    p.add_argument("--topology", default="local-cpu-4", help="topology file or packaged name")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    p.add_argument("job_args", nargs=argparse.REMAINDER, help="-- [--max-tokens N] [--prompt P] ...")
    p.set_defaults(func=_cmd)
