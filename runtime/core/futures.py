"""Completing a ``concurrent.futures.Future`` from whichever thread gets there first.

Leaf module: standard library only.

An I/O thread, a heartbeat and ``close()`` may each try to fail the same request,
and a caller may cancel it meanwhile; the first completion wins and the others
are no-ops, never an ``InvalidStateError``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


def resolve(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless something already did (never twice, never raising)."""
    try:  # a completed or cancelled future raises InvalidStateError: no done() first, a lock round less
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except Exception:  # lost a race with a canceller or another completer
        pass
