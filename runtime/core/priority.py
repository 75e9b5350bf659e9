"""A request's priority: an int, larger is sooner; checked the same way everywhere it enters.

``Engine.submit``/``step``, every client and the server's decoding of a request take the same
rule, so a priority that one accepts another accepts too (the wire carries it as a msgpack int).
"""

from __future__ import annotations

from typing import Any

#: the range a priority must lie in (a 32-bit signed int, as the C++ client sends it)
PRIORITY_MIN, PRIORITY_MAX = -(2 ** 31), 2 ** 31 - 1


def check_priority(value: Any) -> int:
    """``value`` as a priority: ``TypeError`` for anything but an int (a bool is not one),
    ``ValueError`` outside ``PRIORITY_MIN..PRIORITY_MAX``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"priority must be an int (larger is sooner), got {type(value).__name__} {value!r}"[:200])
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"priority must lie in {PRIORITY_MIN}..{PRIORITY_MAX}, got {value}")
    return value
