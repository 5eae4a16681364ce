"""`zerodram` console script: one argparse tree, one module per subcommand.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func=<callable(args) -> int>` on it. Modules are imported only when the CLI starts, and heavy
imports (torch, cuda) stay inside the command functions so that `--help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from zerodram.runtime import __version__
from zerodram.runtime.errors import ZerodramError

# Order here is the order in `zerodram --help`.
COMMAND_MODULES = [
    "zerodram.launch.topo_cmd",  # topo check / topo show
    "zerodram.launch.launcher",  # launch: derive torchrun's arguments from a topology
    "zerodram.launch.worker",  # worker: what torchrun runs on every rank
    "zerodram.launch.demo_cmd",  # demo: the packaged SmolLM2 as experts on local ranks
    "zerodram.launch.generate_cmd",  # generate: one process, prompts in, text out
    "zerodram.launch.serve_cmd",  # serve: JSON-lines server on a topology's ranks
    "zerodram.launch.eval_kv_cmd",  # eval-kv: perplexity / needle of a real LM through a KV format
    "zerodram.launch.bench_cmd",  # bench dispatch (attention, decode: one line each in bench_cmd)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerodram",
        description="Expert-parallel MoE serving runtime with an FP2 KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"zerodram {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except ZerodramError as err:
        print(f"zerodram: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader left (`zerodram ... | head`): stop quietly, as a tool killed by SIGPIPE would.
        # stdout goes to /dev/null so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
