"""`zerodram serve`: the JSON-lines server on a topology's ranks (sugar over `zerodram launch`).

    zerodram serve --topology local-cpu-4 -- --model smollm2 --input requests.jsonl
is `zerodram launch --topology local-cpu-4 -- serve --model smollm2 --input requests.jsonl`;
`serve_job` is what every rank runs. The request and result formats are in
`zerodram.runtime.engine.jobs`. Results go to --output (default stdout); the dashboard then goes
to stderr, so that stdout carries only JSON lines.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def parse_args(argv: list[str]) -> argparse.Namespace:
    from zerodram.launch.dashboard import add_dashboard_args
    from zerodram.runtime.engine.jobs import add_engine_args

    p = argparse.ArgumentParser(prog="serve", description="serve JSON-lines requests on every rank")
    add_engine_args(p)
    add_dashboard_args(p)
    p.add_argument("--input", default="-", help="requests file (JSON lines; - = stdin), rank 0")
    p.add_argument("--output", default="-", help="results file (JSON lines; - = stdout), rank 0")
    p.add_argument("--stream", action="store_true", help="a line per sampled token, then the result")
    return p.parse_args(argv)


def serve_job(ctx: Any, argv: list[str]) -> int:
    """The serve worker job; returns 0. Every rank runs it; rank 0 reads and writes."""
    import torch
    from rich.console import Console

    from zerodram.launch.observe import observe
    from zerodram.runtime.engine.jobs import build_from_args, serve_lines

    args = parse_args(argv)
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # several ranks share few cores
    with build_from_args(args, ctx) as engine:
        if ctx.rank != 0:
            with observe(ctx, engine, args):
                serve_lines(engine, None, None)
            return 0
        # bytes: LineSource decodes each line, so one that is not UTF-8 is refused on its own
        fin = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")  # noqa: SIM115 (closed below)
        fout = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115
        console = Console(stderr=True) if fout is sys.stdout else None
        try:
            with observe(ctx, engine, args, console=console):
                read_error = serve_lines(engine, fin, fout, stream=args.stream)
            if read_error is not None:  # after observe's barriers: the other ranks end cleanly
                raise read_error
        finally:
            if fin is not sys.stdin.buffer:
                fin.close()
            if fout is not sys.stdout:
                fout.close()
    return 0


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
    p.add_argument(
        "job_args",
        nargs=argparse.REMAINDER,
        help="-- [--model M] [--input F] [--kv K] [--no-dashboard] [--metrics-file PATH] ...",
    )
    p.set_defaults(func=_cmd)
