"""The one multi-rank test launcher: run a function on N ranks, as torchrun would.

    results = run_ranks(fn, world_size=4, args=(...,))    # -> [fn's return value per rank]

Each rank is a fresh process (spawn) with torchrun's variables set (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT on a free port), a `RankContext` built and
passed to `fn(ctx, *args)`, and always closed. Output lines are prefixed with `[rank N]`. If any
rank raises, the test fails with that rank's traceback; if the ranks do not finish within
`timeout_s`, they are killed and the test fails naming the ranks still running.

`fn` must be importable from the child (a module-level function of a test module or the package).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailedError(AssertionError):
    """A rank raised, or the ranks timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Prefixed:
    """A text stream wrapper that prefixes each line with the rank."""

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream, self._prefix, self._at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _child(
    fn: Callable,
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    kwargs: dict,
    env: dict[str, str],
    results: mp.Queue,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")
    from zerodram.runtime.context import RankContext

    ctx = None
    try:
        topology = kwargs.pop("topology", None)
        ctx = RankContext.create(
            topology, device=kwargs.pop("device", None), timeout_s=kwargs.pop("timeout_s", None)
        )
        value = fn(ctx, *args, **kwargs)
        # Pickled here, by value: through the queue itself a CPU tensor travels as a handle to this
        # process's shared memory, which the parent must open before this process exits (a loaded
        # machine lost that race: FileNotFoundError in the parent, CI of stop 65).
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as err:  # report everything, including SystemExit from a worker
        results.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if ctx is not None:
            ctx.close()
        sys.stdout.flush()
        sys.stderr.flush()


def run_ranks(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(ctx, *args, **kwargs)` on `world_size` ranks; return the per-rank results.

    Keyword arguments `topology`, `device` and `timeout_s`-of-the-context are consumed by the
    launcher: pass `topology=` to check the world against a `Topology`; `rank_timeout_s=` sets the
    context's collective timeout (default: ZERODRAM_WAIT_TIMEOUT_S).

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or `timeout_s` expired.
    """
    if "rank_timeout_s" in kwargs:
        kwargs["timeout_s"] = kwargs.pop("rank_timeout_s")
    ctx_mp = mp.get_context("spawn")
    results: mp.Queue = ctx_mp.Queue()
    port = free_port()
    procs = [
        ctx_mp.Process(
            target=_child,
            name=f"rank{r}",
            args=(fn, r, world_size, port, args, dict(kwargs), env or {}, results),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = sorted(set(range(world_size)) - set(got))
                raise RankFailedError(
                    f"ranks {waiting} of {world_size} did not finish within {timeout_s:.0f}s"
                )
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
                got[rank] = (ok, pickle.loads(value) if ok else value)
                if not ok:
                    break  # fail fast: the first rank to raise is the root cause, usually
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailedError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} without reporting"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = [(r, v) for r, (ok, v) in sorted(got.items()) if not ok]
    if failures:
        rank, tb = failures[0]
        raise RankFailedError(f"rank {rank} of {world_size} raised:\n{tb}")
    return [got[r][1] for r in range(world_size)]
