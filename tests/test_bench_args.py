"""Every benchmark refuses a bad number when its command line is parsed (`runtime/argtypes.py`),
as a usage error naming the flag, never as a traceback from deep inside a run."""

from __future__ import annotations

import argparse

import pytest
from bench_cli import load_script

CASES = [
    ("decode", ["--iters", "-1"]),
    ("decode", ["--iters", "0"]),
    ("decode", ["--warmup", "-1"]),
    ("decode", ["--contexts", "0"]),
    ("decode", ["--batches", "x"]),
    ("dispatch", ["--iters", "0"]),
    ("dispatch", ["--warmup", "-1"]),
    ("dispatch", ["--hidden", "0"]),
    ("dispatch", ["--tokens", "x"]),
    ("attention", ["--batches", "0"]),
    ("attention", ["--lengths", "8192,x"]),
    ("attention_timeline", ["--batches", "0"]),
    ("attention_timeline", ["--lengths", "-1"]),
    ("engine_step", ["--batches", "1,0"]),
    ("experts", ["--batches", ""]),
    ("p_rounding", ["--lengths", "x"]),
]


@pytest.mark.parametrize(("script", "argv"), CASES)
def test_benchmarks_refuse_bad_numbers_when_parsing(
    script: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    p = argparse.ArgumentParser()
    load_script(script).add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(argv)
    assert f"argument {argv[0]}: expected " in capsys.readouterr().err
