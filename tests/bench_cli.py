"""The benchmark scripts from tests: `zerodram bench NAME ...` in a fresh interpreter (what a user
types, through launch/bench_cmd.py), and a script loaded as a module for its pure functions
(`benchmarks/` is not a package)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (registered while it executes: dataclasses look it up)."""
    key = f"zerodram_test_bench_{name}"
    spec = importlib.util.spec_from_file_location(key, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


def run_bench(argv: list[str], *, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """`zerodram bench *argv` in a new Python process; stdout and stderr captured as text."""
    code = (
        "import argparse, sys; from zerodram.launch import bench_cmd; p = argparse.ArgumentParser(); "
        f"bench_cmd.register(p.add_subparsers()); a = p.parse_args(['bench', *{argv!r}]); sys.exit(a.func(a))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


def assert_refuses_without_gpu(name: str) -> None:
    """`zerodram bench NAME` on a machine without a GPU exits 2 and says it needs one."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    out = run_bench([name])
    assert out.returncode == 2, out.stderr[-2000:]
    assert "needs a CUDA GPU" in out.stderr
