"""A third-party-like plugin module: plain ``Entry`` subclasses plus a few decoys."""

from __future__ import annotations

from typing import Any

from runtime.core.plugins import Entry


class DoubleRunner:
    def execute(self, request: Any) -> Any:
        return request * 2


class DoubleEntry(Entry):
    """Declares the dense domain; doubles whatever it is given."""

    name = "fixture-double"
    parallel_domains = frozenset({"dense"})

    def build(self, ctx, plugin_args):
        return DoubleRunner()


class SingleRankEntry(Entry):
    """Declares no domain: single rank only."""

    name = "fixture-single"

    def build(self, ctx, plugin_args):
        return DoubleRunner()


class Outer:
    class NestedEntry(Entry):
        """An Entry reachable only as ``Outer.NestedEntry``."""

        name = "fixture-nested"


class NotAnEntry:
    """A class, but not an Entry subclass."""


def not_a_class() -> None:
    """A callable, not a class."""


NOT_A_CLASS = 42
