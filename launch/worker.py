"""What torchrun runs on every rank: `python -m zerodram.launch.worker JOB [ARGS...]`.

The worker builds the rank context (torchrun's environment + the topology named by
ZERODRAM_TOPOLOGY), runs one job from `JOBS`, and always tears the context down. A job is
`fn(ctx: RankContext, argv: list[str]) -> int`: a thin entry point over `zerodram.runtime` (fat
library); jobs that show the dashboard (serve, demo) live in launch/, next to their commands,
because the runtime never imports the launch side. Only rank 0 prints unless a job says otherwise;
every rank that fails prints its own error, with its rank.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from zerodram.runtime.errors import ConfigError, ZerodramError

# name -> "module:function". Add a job with one line.
JOBS = {
    "smoke": "zerodram.runtime.smoke:run",
    "serve": "zerodram.launch.serve_cmd:serve_job",
    "demo": "zerodram.launch.demo_cmd:demo_job",
}
# name -> "module:function" of the job's option parser, `parse_args(argv) -> Namespace` with the
# dashboard's options (`add_dashboard_args`: the output paths checked). `zerodram launch` runs it
# once before torchrun starts (`check_job`), so that --help or a bad value is answered by one
# process rather than by every rank (and not after the model loaded).
PARSERS = {
    "serve": "zerodram.launch.serve_cmd:parse_args",
    "demo": "zerodram.launch.demo_cmd:parse_args",
}


def _require_job(job: str) -> None:
    if job not in JOBS:
        raise ConfigError(f"unknown job {job!r}; jobs: {', '.join(sorted(JOBS))}")


def _load(target: str) -> Callable:
    """ "module:function" -> the function."""
    module, fn = target.split(":")
    return getattr(importlib.import_module(module), fn)


def check_job(job: str, argv: list[str], node_rank: int) -> None:
    """In the launching process: refuse an unknown job, parse a known job's options, and on node 0
    (where rank 0 runs and writes) check the output paths they name.

    Raises:
        ConfigError: an unknown job or an unwritable output path. SystemExit: argparse's, for
            --help (0) or a bad option (2).
    """
    _require_job(job)  # the job's own module is imported on the ranks only (smoke's imports torch)
    if job in PARSERS:
        from zerodram.launch.dashboard import check_output_paths

        args = _load(PARSERS[job])(argv)
        if node_rank == 0:
            check_output_paths(args)


def run_job(job: str, argv: list[str]) -> int:
    """Run `job` in this process as one rank of a torchrun job; returns its exit code."""
    from zerodram.runtime.context import RankContext
    from zerodram.runtime.envs import ENVS
    from zerodram.runtime.topology import load_topology, resolve_topology_path

    _require_job(job)
    target = _load(JOBS[job])
    topo_name = ENVS.TOPOLOGY.get()
    topology = load_topology(resolve_topology_path(topo_name)) if topo_name else None
    with RankContext.create(topology) as ctx:
        return int(target(ctx, argv) or 0)


def _cmd(args: argparse.Namespace) -> int:
    return run_job(args.job, args.job_args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run one job as a rank of a torchrun job (what `zerodram launch` starts)",
        description="Run JOB as one rank; torchrun's environment and ZERODRAM_TOPOLOGY say which.",
    )
    p.add_argument("job", choices=sorted(JOBS), help="the job to run")
    p.add_argument("job_args", nargs=argparse.REMAINDER, help="arguments passed to the job")
    p.set_defaults(func=_cmd)


def main() -> int:
    if len(sys.argv) < 2:
        print(f"usage: python -m zerodram.launch.worker JOB [ARGS]; jobs: {', '.join(JOBS)}", file=sys.stderr)
        return 2
    try:
        return run_job(sys.argv[1], sys.argv[2:])
    except ZerodramError as err:
        # every rank that fails says so, and which rank it is: ranks may fail for different reasons
        # (their own shard, GPU or peer), and torchrun's summary names only the first to exit
        print(f"zerodram worker ({_which_rank()}): error: {err}", file=sys.stderr)
        return err.exit_code


def _which_rank() -> str:
    """"rank R of W" from torchrun's environment, read raw: the error may be that it is malformed."""
    import os

    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    return f"rank {rank} of {world}"


if __name__ == "__main__":
    sys.exit(main())
