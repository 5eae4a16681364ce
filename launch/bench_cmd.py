"""`zerodram bench SUBCOMMAND`: a thin dispatcher to the benchmark modules.

Add a subcommand with one line in `SUBCOMMANDS`: name -> (target, help). A target is
"module:" (an importable module) or "path.py:" relative to the repository root (the `benchmarks/`
folder is not installed as a package); the module provides `add_arguments(parser)` and
`run(args) -> int`. Heavy imports happen inside `run`, so `--help` stays instant. Run directly
(`python benchmarks/NAME.py ...`), a script hands the same two to `run_script`. A benchmark split
over several files loads its siblings with `load_sibling`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from zerodram.runtime.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "dispatch": ("benchmarks/dispatch.py", "MoE dispatch/combine latency: NVSHMEM vs host-driven"),
    "attention": ("benchmarks/attention.py", "FP2 decode attention vs FP16 SDPA: ms, GB/s, speedup"),
    "split-table": ("benchmarks/split_table.py", "a GPU's measured split counts from attention sweeps (--sweep N: time them first; --write: into the package)"),
    "attention-timeline": ("benchmarks/attention_timeline.py", "FP2 decode attention per CTA: start, loop, merge times"),
    "experts": ("benchmarks/experts.py", "routed SwiGLU experts at decode sizes: kernel vs grouped_mm vs loop"),
    "decode": ("benchmarks/decode.py", "one MoE layer's decode step: FP2 + fused vs BF16 + host, floors"),
    "issue-rates": ("benchmarks/issue_rates.py", "warp instructions per cycle of single instructions and pairs (a probe)"),
    "settle": ("benchmarks/settle_probe.py", "how long a decode runs slow after heavy GPU work (a probe)"),
    "p-rounding": ("benchmarks/p_rounding.py", "decode-attention output error with P rounded to e4m3 or fp16 (a probe)"),
    "sass": ("benchmarks/sass_census.py", "the decode kernel's main loop in SASS: instructions per stage, no GPU needed"),
    "kv-quality": ("benchmarks/kv_quality.py", "every KV format's perplexity on SmolLM2, into docs/kv-quality.md (--render-only: rewrite the doc)"),
    "ab-report": ("benchmarks/ab_report.py", "the table of an ab.sh run: a metric's range over rounds, per case and variant"),
}


def load_sibling(script: str, name: str) -> ModuleType:
    """NAME.py beside `script` (a benchmark's __file__) as a module, loaded once: how a benchmark
    imports its sibling files (benchmarks/ is not a package, and a script run directly has no import
    path to it).
    """
    return _load_file(Path(script).resolve().with_name(f"{name}.py"))


def _load(target: str) -> ModuleType:
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = REPO_ROOT / target
    if not path.exists():
        raise ConfigError(f"benchmark {target} not found under {REPO_ROOT} (run from a source checkout)")
    return _load_file(path)


def _load_file(path: Path) -> ModuleType:
    name = "zerodram_bench_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks (dispatch, ...)", description="Run a benchmark; see SUBCOMMAND --help."
    )
    inner = p.add_subparsers(dest="bench", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])  # `zerodram bench`: list them
    for name, (target, text) in SUBCOMMANDS.items():
        try:
            module = _load(target)
        except ConfigError as err:  # an installed copy without benchmarks/: only this subcommand fails
            q = inner.add_parser(name, help=text, description=text, add_help=True)
            q.set_defaults(func=_missing(err))
            continue
        q = inner.add_parser(name, help=text, description=(module.__doc__ or text).strip().splitlines()[0])
        module.add_arguments(q)
        q.set_defaults(func=module.run)


def run_script(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], int]) -> int:
    """`python benchmarks/NAME.py ...`: the module's own arguments and run, as `zerodram bench NAME`."""
    p = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0])
    add_arguments(p)
    return run(p.parse_args())


def _missing(err: ConfigError):
    def run(args: argparse.Namespace) -> int:
        raise err

    return run
