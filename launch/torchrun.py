"""torchrun, as `zerodram launch` runs it: `python -m zerodram.launch.torchrun [torchrun's args]`.

torchrun itself, with one change: when a rank fails, torchrun raises ChildFailedError, which prints
a traceback of its own agent and a 20-line failure table, and exits 1 whatever the rank's code was.
The ranks have already said what went wrong (worker.py prints every failing rank's error with its
rank), so here the failure is one line naming the rank that failed first and how, and the exit code
is that rank's (a rank killed by a signal gives 128 + the signal, as a shell does).
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def first_failure_line(err: ChildFailedError) -> tuple[str, int]:
    """The first rank to fail, in words, and the exit code to return for it."""
    rank, failure = err.get_first_failure()
    code = failure.exitcode
    if code < 0:  # torchrun reports a signal as minus its number
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        code = 128 - code
    else:
        how = f"exited with code {code}"
    others = len(err.failures) - 1  # torchrun stops the rest when one fails
    also = f"; {others} other rank(s) stopped too" if others else ""
    return f"zerodram launch: rank {rank} (local rank {failure.local_rank}) {how} first{also}", code or 1


def main() -> int:
    args = get_args_parser().parse_args()
    try:
        run(args)
    except ChildFailedError as err:
        line, code = first_failure_line(err)
        print(line, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
