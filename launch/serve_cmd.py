"""`zerodram serve`: the JSON-lines server on a topology's ranks (sugar over `zerodram launch`).

    zerodram serve --topology local-cpu-4 -- --model smollm2 --input requests.jsonl
is `zerodram launch --topology local-cpu-4 -- serve --model smollm2 --input requests.jsonl`.
The request and result formats are in `zerodram.runtime.engine.jobs`.
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
        node_rank=args.node_rank,
        master_port=args.master_port,
        dry_run=args.dry_run,
        job=["serve", *rest],
    )
    return launcher._cmd(ns)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve JSON-lines requests on a topology's ranks (rank 0 reads and writes)",
        description="Launch the serve job: rank 0 reads JSON lines (prompt, params) from --input "
        "(default stdin) and writes one JSON line per finished request. Engine options after --.",
    )
    p.add_argument("--topology", default="local-cpu-4", help="topology file or packaged name")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    p.add_argument("job_args", nargs=argparse.REMAINDER, help="-- [--model M] [--input F] [--kv K] ...")
    p.set_defaults(func=_cmd)
