"""`zerodram bench issue-rates` on CPU: its argument check and its refusal without a GPU (the
probe kernel itself compiles in tests/test_jit.py; its rates are measured on the GPU machine)."""

from __future__ import annotations

import pytest
from bench_cli import load_script, run_bench


def test_pairs_parse_and_unknown_names_are_named() -> None:
    mod = load_script("issue_rates")
    assert mod._parse("LOP3,PRMT+IMAD.HI") == [("LOP3", "LOP3"), ("PRMT", "IMAD.HI")]
    with pytest.raises(SystemExit, match=r"'IMAD\.WIDE'"):
        mod._parse("PRMT+IMAD.WIDE")


def test_refuses_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the probe would run")
    out = run_bench(["issue-rates"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert "needs a CUDA GPU" in out.stderr
