"""A tiny stepped plugin that streams, for tests of the generic streaming path.

``tests.stream_plugins:Ticker``: request ``{"n": int >= 1, "delay": seconds per step,
"die_at": k}``; every step gives each request its next item ``i`` (0, 1, ...). Result:
``{"items": [0, ..., n-1], "done": True}``. Streamed (``add_stream``): chunks
``{"items": [i]}``, the last ``{"items": [n-1], "done": True}``. ``cancel`` drops a request
and reports it at the next step. Every rank runs its own copy (no collectives); with
``die_at`` the rank of ``world rank 1`` exits at that item (a rank death mid-stream).

``tests.stream_plugins:Paced`` (inline only): the test sets the pace. Request ``{"n": int >= 1,
"pace": name}`` (``Pace().request(n)``); chunk ``i`` (``{"items": [i]}``, the last with
``"done": True``) is made only once the test let it out (``Pace.release``). The pace records
when each chunk was made and whether the runner was told to cancel the request.
"""

from __future__ import annotations

import itertools
import os
import threading
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


#: Paced requests' paces, by name (inline: the runner and the test share this process)
paces: dict[str, "Pace"] = {}
_pace_names = itertools.count()


class Pace:
    """The test's hand on one ``Paced`` request: ``release(k)`` lets ``k`` more chunks out."""

    def __init__(self) -> None:
        self.name = f"pace-{next(_pace_names)}"
        self.gate = threading.Semaphore(0)
        self.made: list[float] = []  # time.monotonic() at each chunk made
        self.cancelled = threading.Event()  # the runner was told to cancel the request
        paces[self.name] = self

    def request(self, n: int) -> dict:
        return {"n": n, "pace": self.name}

    def release(self, k: int = 1) -> None:
        self.gate.release(k)


class PacedRunner:
    def __init__(self) -> None:
        self._active: dict[Any, list] = {}  # id -> [pace, n, next item, streamed]
        self._dropped: list[Any] = []

    def add(self, request_id: Any, request: Any) -> None:
        self._active[request_id] = [paces[request["pace"]], request["n"], 0, False]

    def add_stream(self, request_id: Any, request: Any) -> None:
        self._active[request_id] = [paces[request["pace"]], request["n"], 0, True]

    def cancel(self, request_id: Any) -> None:
        state = self._active.pop(request_id, None)
        if state is not None:
            state[0].cancelled.set()
            self._dropped.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._active or self._dropped)

    def step(self) -> list[tuple[Any, Any]]:
        out: list[tuple[Any, Any]] = [(request_id, None) for request_id in self._dropped]
        self._dropped = []
        for request_id, state in list(self._active.items()):
            pace, n, item, streamed = state
            if not pace.gate.acquire(timeout=0.005):  # not let out yet (a short wait: no busy loop)
                continue
            pace.made.append(time.monotonic())
            state[2] = item + 1
            if item + 1 < n:
                if streamed:
                    out.append((request_id, Partial({"items": [item]})))
                continue
            del self._active[request_id]
            out.append((request_id, {"items": [item] if streamed else list(range(n)), "done": True}))
        return out


class Paced(Entry):
    def validate_request(self, request: Any) -> None:
        if not (isinstance(request, dict) and isinstance(request.get("n"), int) and request["n"] >= 1
                and request.get("pace") in paces):
            raise ValueError('paced takes {"n": int >= 1, "pace": the name of a Pace}')

    def build(self, ctx, plugin_args):
        return PacedRunner()
