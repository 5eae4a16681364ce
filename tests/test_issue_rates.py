"""`zerodram bench issue-rates` on CPU: its argument check and its refusal without a GPU (the
probe kernel itself compiles in tests/test_jit.py; its rates are measured on the GPU machine)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("issue_rates", REPO / "benchmarks" / "issue_rates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pairs_parse_and_unknown_names_are_named() -> None:
    mod = _module()
    assert mod._parse("LOP3,PRMT+IMAD.HI") == [("LOP3", "LOP3"), ("PRMT", "IMAD.HI")]
    with pytest.raises(SystemExit, match=r"'IMAD\.WIDE'"):
        mod._parse("PRMT+IMAD.WIDE")


def test_refuses_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the probe would run")
    code = (
        "import argparse, sys; from zerodram.launch import bench_cmd; p = argparse.ArgumentParser(); "
        "bench_cmd.register(p.add_subparsers()); a = p.parse_args(['bench', 'issue-rates']); sys.exit(a.func(a))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "needs a CUDA GPU" in out.stderr
