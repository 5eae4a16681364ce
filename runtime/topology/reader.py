"""Typed, positioned access to a composed YAML node tree.

`yaml.compose` keeps every node's start mark, so each value read here can be traced back to a
line and column. The reader records the mark of every field it visits under its dotted path
(``nodes[1].gpus[0].nic.gbps``); a `ConfigError` raised later with only a `field` (from a
dataclass invariant) is located through those marks by `Reader.locate`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from zerodram.runtime.errors import ConfigError

_TAG = "tag:yaml.org,2002:"


def join(field: str, key: str | int) -> str:
    """Extend a dotted field path: join("nodes", 1) -> "nodes[1]", join("kv", "format") -> "kv.format"."""
    if isinstance(key, int):
        return f"{field}[{key}]"
    return f"{field}.{key}" if field else key


def describe(node: Node) -> str:
    """How an unexpected node reads in an error message: "a string 'abc'", "a list", ..."""
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    kind = {
        "str": "a string",
        "int": "an integer",
        "float": "a number",
        "bool": "a boolean",
        "null": "nothing (null)",
    }.get(node.tag.removeprefix(_TAG), "a value")
    return kind if kind.startswith("nothing") else f"{kind} {node.value!r}"


@dataclass(frozen=True)
class Entry:
    """One key of a mapping: the key's own node (for 'unknown key' errors) and its value."""

    key: Node
    value: Node


class Reader:
    """Reads one file's node tree. Every method raises `ConfigError` at the offending node."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.marks: dict[str, yaml.Mark] = {}
        self._ctor = SafeConstructor()

    # -- errors ------------------------------------------------------------------------------

    def error(self, node: Node | yaml.Mark | None, field: str | None, message: str) -> ConfigError:
        """A ConfigError at `node` (or at a mark), naming this file and `field`."""
        mark = node.start_mark if isinstance(node, Node) else node
        return ConfigError(
            message,
            path=str(self.path),
            line=mark.line + 1 if mark is not None else None,
            column=mark.column + 1 if mark is not None else None,
            field=field or None,
        )

    def locate(self, err: ConfigError) -> ConfigError:
        """Give a position-less error (raised by a dataclass invariant) this file and a line.

        Uses the mark of the deepest recorded prefix of `err.field`; a field never read falls
        back to its nearest read parent, and at worst to the top of the file.
        """
        if err.line is not None:
            return err
        field = err.field or ""
        while field and field not in self.marks:
            field = _parent(field)
        return self.error(self.marks.get(field), err.field, err.message)

    # -- structure ---------------------------------------------------------------------------

    def mapping(
        self,
        node: Node,
        field: str,
        known: Iterable[str],
        required: Iterable[str] = (),
    ) -> dict[str, Entry]:
        """Check `node` is a mapping whose keys are all in `known` and include `required`.

        Unknown keys are errors with the closest known key suggested; duplicate keys are errors
        (plain PyYAML silently keeps the last one).
        """
        known = tuple(known)
        self._record(field, node)
        if not isinstance(node, MappingNode):
            what = f"'{field}'" if field else "the top level"
            raise self.error(node, field, f"expected a mapping for {what}, got {describe(node)}")
        out: dict[str, Entry] = {}
        for key_node, value_node in node.value:
            if not (isinstance(key_node, ScalarNode) and key_node.tag == _TAG + "str"):
                raise self.error(key_node, field, f"expected a key name, got {describe(key_node)}")
            key = key_node.value
            sub = join(field, key)
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                maybe = f"; did you mean '{hint[0]}'?" if hint else ""
                raise self.error(
                    key_node, sub, f"unknown key '{key}'{maybe} (known keys: {', '.join(known)})"
                )
            if key in out:
                first = out[key].key.start_mark.line + 1
                raise self.error(key_node, sub, f"duplicate key '{key}' (first given on line {first})")
            out[key] = Entry(key_node, value_node)
            self._record(sub, value_node)
        for key in required:
            if key not in out:
                raise self.error(node, join(field, key), f"missing required key '{key}'")
        return out

    def sequence(self, node: Node, field: str, *, non_empty: bool = False) -> list[Node]:
        """Check `node` is a list; record each item as ``field[i]``."""
        self._record(field, node)
        if not isinstance(node, SequenceNode):
            raise self.error(node, field, f"expected a list, got {describe(node)}")
        if non_empty and not node.value:
            raise self.error(node, field, "expected a non-empty list")
        for i, item in enumerate(node.value):
            self._record(join(field, i), item)
        return list(node.value)

    def int_keyed(self, node: Node, field: str, what: str) -> list[tuple[int, Node]]:
        """A mapping keyed by non-negative integers (``experts.map``: rank -> experts)."""
        self._record(field, node)
        if not isinstance(node, MappingNode):
            raise self.error(node, field, f"expected a mapping of {what} -> list, got {describe(node)}")
        out: list[tuple[int, Node]] = []
        seen: dict[int, int] = {}
        for key_node, value_node in node.value:
            key = self.int_(key_node, field, minimum=0, what=f"a {what}")
            sub = join(field, key)
            if key in seen:
                raise self.error(key_node, sub, f"duplicate {what} {key} (first given on line {seen[key]})")
            seen[key] = key_node.start_mark.line + 1
            # The key's mark: "rank 9 does not exist" points at the 9; items record their own.
            self._record(sub, key_node)
            out.append((key, value_node))
        return out

    # -- scalars -----------------------------------------------------------------------------

    def int_(self, node: Node, field: str, *, minimum: int | None = None, what: str | None = None) -> int:
        """An integer (booleans are not integers here), optionally bounded below.

        `what` names the integer in messages: "expected a rank (an integer >= 0), got -1".
        """
        expected = f"{what} (an integer)" if what else "an integer"
        value = self._scalar(node, field, ("int",), expected)
        if minimum is not None and value < minimum:
            bound = f"an integer >= {minimum}"
            raise self.error(node, field, f"expected {f'{what} ({bound})' if what else bound}, got {value}")
        return value

    def number(self, node: Node, field: str) -> float:
        """A positive, finite int or float (bandwidths)."""
        try:
            value = float(self._scalar(node, field, ("int", "float"), "a number"))
        except OverflowError:  # an integer past the float range (~1.8e308)
            value = math.inf
        # inf / nan (`.inf`, `1.0e+400`, `.nan`) would poison every byte floor and ratio taken from it.
        if not math.isfinite(value):
            text = node.value if len(node.value) <= 20 else node.value[:20] + "..."
            raise self.error(node, field, f"expected a finite number, got {text!r}")
        if not value > 0:
            raise self.error(node, field, f"expected a positive number, got {value:g}")
        return value

    def str_(self, node: Node, field: str, *, choices: Iterable[str] | None = None) -> str:
        """A non-empty string, optionally one of `choices` (with a suggestion when close)."""
        value = self._scalar(node, field, ("str",), "a string")
        if not value:
            raise self.error(node, field, "expected a non-empty string")
        if choices is not None:
            choices = tuple(choices)
            if value not in choices:
                hint = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
                maybe = f"; did you mean '{hint[0]}'?" if hint else ""
                raise self.error(node, field, f"expected one of {', '.join(choices)}, got '{value}'{maybe}")
        return value

    def bool_(self, node: Node, field: str) -> bool:
        return self._scalar(node, field, ("bool",), "true or false")

    def int_list(self, node: Node, field: str, *, what: str | None = None) -> list[int]:
        """A list of non-negative integers."""
        items = self.sequence(node, field)
        return [self.int_(item, join(field, i), minimum=0, what=what) for i, item in enumerate(items)]

    # -- helpers -----------------------------------------------------------------------------

    def _scalar(self, node: Node, field: str, tags: tuple[str, ...], expected: str):
        if not (isinstance(node, ScalarNode) and node.tag.removeprefix(_TAG) in tags):
            hint = (
                " (quote it to make it a string)" if tags == ("str",) and isinstance(node, ScalarNode) else ""
            )
            raise self.error(node, field, f"expected {expected}, got {describe(node)}{hint}")
        try:
            return self._ctor.construct_object(node)
        # LookupError: an explicit tag (`!!bool maybe`, `!!int ""`) skips the resolver's pattern,
        # and SafeConstructor's parsers then index and look up text they assume it matched.
        except (ConstructorError, ValueError, LookupError) as err:
            raise self.error(node, field, f"expected {expected}, got {node.value!r}") from err

    def _record(self, field: str, node: Node) -> None:
        self.marks.setdefault(field, node.start_mark)


def _parent(field: str) -> str:
    """``a.b[2]`` -> ``a.b`` -> ``a`` -> ``""``."""
    cut = max(field.rfind("."), field.rfind("["))
    return field[:cut] if cut > 0 else ""
