"""A tiny stepped plugin that streams, for tests of the generic streaming path.

``tests.stream_plugins:Ticker``: request ``{"n": int >= 1, "delay": seconds per step,
"die_at": k}``; every step gives each request its next item ``i`` (0, 1, ...). Result:
``{"items": [0, ..., n-1], "done": True}``. Streamed (``add_stream``): chunks
``{"items": [i]}``, the last ``{"items": [n-1], "done": True}``. ``cancel`` drops a request
and reports it at the next step. Every rank runs its own copy (no collectives); with
``die_at`` the rank of ``world rank 1`` exits at that item (a rank death mid-stream).
"""

from __future__ import annotations

import os
import time
from typing import Any

from runtime import Entry, Partial

#: inline only (the runner lives in the test's process): ids cancelled, and ids still held
cancelled: list[Any] = []
held: set[Any] = set()


class TickerRunner:
    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._active: dict[Any, list] = {}  # id -> [request, next item, streamed]
        self._dropped: list[Any] = []

    def add(self, request_id: Any, request: Any) -> None:
        self._active[request_id] = [request, 0, False]
        held.add(request_id)

    def add_stream(self, request_id: Any, request: Any) -> None:
        self._active[request_id] = [request, 0, True]
        held.add(request_id)

    def cancel(self, request_id: Any) -> None:
        if self._active.pop(request_id, None) is not None:
            cancelled.append(request_id)
            held.discard(request_id)
            self._dropped.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._active or self._dropped)

    def step(self) -> list[tuple[Any, Any]]:
        out: list[tuple[Any, Any]] = [(request_id, None) for request_id in self._dropped]
        self._dropped = []
        delay = max((state[0].get("delay", 0.0) for state in self._active.values()), default=0.0)
        if delay:
            time.sleep(delay)
        for request_id, state in list(self._active.items()):
            request, item, streamed = state
            if self._rank == 1 and request.get("die_at") == item:
                os._exit(3)
            state[1] = item + 1
            last = item + 1 == request["n"]
            if not last:
                if streamed:
                    out.append((request_id, Partial({"items": [item]})))
                continue
            del self._active[request_id]
            held.discard(request_id)
            chunk = {"items": [item] if streamed else list(range(request["n"])), "done": True}
            out.append((request_id, chunk))
        return out


class Ticker(Entry):
    parallel_domains = frozenset({"dense", "attention"})

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or not isinstance(request.get("n"), int) or request["n"] < 1:
            raise ValueError('ticker takes {"n": int >= 1, ...}')

    def build(self, ctx, plugin_args):
        return TickerRunner(ctx.rank)
