"""The exceptions zerodram raises on purpose.

Every error a user can cause is a `ZerodramError`; the CLI prints its message (no traceback) and
exits with its `exit_code`. Anything else escaping is a bug in zerodram.
"""

from __future__ import annotations


class ZerodramError(Exception):
    """Base class: a clear, user-facing failure."""

    exit_code = 1


class ConfigError(ZerodramError):
    """Bad input in a file or on the command line (exit code 2).

    Args:
        message: what is wrong and what was expected.
        path: the file, if the input came from one.
        line, column: 1-based position in that file, when known.
        field: dotted path of the offending field, e.g. ``nodes[1].gpus[0].nic.gbps``.
    """

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        column: int | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.line = line
        self.column = column
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
            where += ": "
        field = f"field '{self.field}': " if self.field else ""
        return f"{where}{field}{self.message}"


class WorldMismatchError(ZerodramError):
    """torchrun started a different world than the topology describes (exit code 2)."""

    exit_code = 2


class RankTimeoutError(ZerodramError):
    """A bounded cross-rank wait expired; the message names who waited for what."""

    exit_code = 3
