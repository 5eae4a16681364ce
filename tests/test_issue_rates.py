"""`zerodram bench issue-rates` on CPU: its argument check and its refusal without a GPU (the
probe kernel itself compiles in tests/test_jit.py; its rates are measured on the GPU machine)."""

from __future__ import annotations

import pytest
from bench_cli import assert_refuses_without_gpu, load_script


def test_pairs_parse_and_unknown_names_are_named() -> None:
    mod = load_script("issue_rates")
    assert mod._parse("LOP3,PRMT+IMAD.HI") == [("LOP3", "LOP3"), ("PRMT", "IMAD.HI")]
    with pytest.raises(SystemExit, match=r"'IMAD\.WIDE'"):
        mod._parse("PRMT+IMAD.WIDE")


def test_refuses_without_a_gpu() -> None:
    assert_refuses_without_gpu("issue-rates")
