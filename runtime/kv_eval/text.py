"""Evaluation text: the Python docs shipped with CPython (`pydoc`) or any UTF-8 file."""

from __future__ import annotations

from pathlib import Path

from zerodram.runtime.errors import ConfigError


def load_text(name: str) -> str:
    """'pydoc': the `pydoc_data.topics` help texts joined by newlines (insertion order), else a file.

    Raises:
        ConfigError: the file does not exist.
    """
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n".join(topics.values())
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(f"text {name!r} is neither 'pydoc' nor a file")
    return path.read_text(encoding="utf-8", errors="replace")
