"""Argument checks shared by the configs: a bad value raises ``TypeError`` or ``ValueError``
naming the owner, the field, the value and the rule.

Leaf module: standard library only.
"""

from __future__ import annotations

import math
from typing import Any


def check_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def check_seconds(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}.{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a finite number of seconds > 0, got {value!r}")
