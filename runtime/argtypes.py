"""argparse `type=` callables for numbers, shared by the commands (launch/, runtime/engine/jobs.py) and
the benchmarks.

    p.add_argument("--iters", type=int_at_least(1))
    p.add_argument("--batches", type=int_list)        # "1,8,64" -> (1, 8, 64)

A bad value is refused when the command line is parsed, as a usage error naming the flag and the
value, never as a traceback from deep inside a run (or silently replaced by a default).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """A type that accepts an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return n

    return parse


def int_list(text: str) -> tuple[int, ...]:
    """A comma list of integers >= 1, e.g. "1,8,64"."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, got {text!r}")
    return values
