"""Lanes: a replica's requests that wait for its runner, by priority, taken in batches.

    submit (any thread) --put(item, priority)--> heap of (-priority, seq)  --take()--> a batch
                                                  + per batch key, a count      (highest priority
                                                                                 first, FIFO in a level)

Both replica kinds that queue use it: the inline executor's serve thread (``wait``: block until a
batch is due) and a local replica's ring writer (``due``/``take`` from whichever thread answers or
submits, with the supervisor's link thread as the timer). One implementation of the rule:

- **Order.** Larger priority first; within a level, submission order. Priority never preempts
  what already runs: it orders only what waits here.
- **Batches** (``max_size > 1``): a batch holds requests of one ``runtime.batching.batch_key``
  (tensors that agree but for the leading dimension), filled from the highest levels first. It
  starts with the request that would go first; others of its key join, in order, up to
  ``max_size``. A batch is due once some key has ``max_size`` requests waiting, or ``delay_s``
  after the oldest request waiting arrived. ``max_size == 1``: each request is due at once,
  alone, and no key is computed.
- **Closing** (``close``): the waiting items are handed back (to be failed by the owner), later
  ``put`` raises, and a ``wait`` returns ``closed``.

Thread-safe (one lock; ``wait`` sleeps on its condition). ``QueueStats`` records each request's
wait here (by priority) and each batch's size.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Callable

from runtime.core.errors import EngineUnavailableError
from runtime.core.queue_stats import QueueStats


class Lanes:
    """Requests waiting for one replica's runner (see the module)."""

    def __init__(self, max_size: int = 1, delay_s: float = 0.0,
                 key: Callable[[Any], Any] | None = None) -> None:
        """``key(request) -> hashable`` groups requests that may share a batch (only with
        ``max_size > 1``); ``put`` computes it in the caller's thread."""
        self.max_size, self.delay_s = max_size, delay_s
        self._key = key if max_size > 1 else None
        self._heap: list[tuple[int, int, float, Any, Any]] = []  # (-priority, seq, arrived, key, item)
        self._counts: dict[Any, int] = {}  # batch key -> requests waiting (batching only)
        self._seq = itertools.count()
        self._cond = threading.Condition(threading.Lock())
        self.closed: str | None = None  # why, once closed
        self.stats = QueueStats()

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, item: Any, request: Any = None, priority: int = 0) -> None:
        """Queue ``item`` (``request`` gives its batch key). EngineUnavailableError once closed."""
        key = self._key(request) if self._key is not None else None
        with self._cond:
            if self.closed is not None:
                raise EngineUnavailableError(self.closed)
            heapq.heappush(self._heap, (-priority, next(self._seq), time.monotonic(), key, item))
            if self._key is not None:
                self._counts[key] = self._counts.get(key, 0) + 1
            self._cond.notify()

    def due(self) -> float | None:
        """When the next batch is due (monotonic; 0.0: at once); None while nothing waits."""
        with self._cond:
            return self._due_locked()

    def _due_locked(self) -> float | None:
        heap = self._heap
        if not heap:
            return None
        if self._key is None or max(self._counts.values()) >= self.max_size:
            return 0.0
        return min(entry[2] for entry in heap) + self.delay_s

    def take(self) -> list[Any]:
        """The next batch if it is due (else []): its items, in order."""
        with self._cond:
            due = self._due_locked()
            if due is None or due > time.monotonic():
                return []
            return self._take_locked()

    def take_all(self) -> list[Any]:
        """Every item waiting, highest priority first (a runner that batches by itself)."""
        with self._cond:
            batch = [heapq.heappop(self._heap) for _ in range(len(self._heap))]
            self._counts.clear()
        self._record(batch, False)
        return [entry[4] for entry in batch]

    def wait(self, block: bool, take: bool = True) -> tuple[list[Any], bool]:
        """The next batch, sleeping until one is due if ``block`` (else [] when none is); and
        whether the lanes are closed (then the batch is empty). ``take=False`` only waits: the
        batch stays queued (``[]`` is returned) for a ``wait(False)`` that takes it later."""
        with self._cond:
            while self.closed is None:
                due = self._due_locked()
                now = time.monotonic()
                if due is not None and due <= now:
                    return (self._take_locked() if take else []), False
                if not block:
                    return [], False
                self._cond.wait(None if due is None else due - now)
            return [], True

    def _take_locked(self) -> list[Any]:
        heap = self._heap
        first = heapq.heappop(heap)
        batch, passed = [first], []
        if self._key is not None:
            key = first[3]
            while heap and len(batch) < self.max_size:
                entry = heapq.heappop(heap)
                (batch if entry[3] == key else passed).append(entry)
            for entry in passed:
                heapq.heappush(heap, entry)
            left = self._counts[key] - len(batch)
            if left:
                self._counts[key] = left
            else:
                del self._counts[key]
        self._record(batch, True)
        return [entry[4] for entry in batch]

    def _record(self, batch: list[tuple[int, int, float, Any, Any]], one_batch: bool) -> None:
        if not batch:
            return
        now = time.monotonic()
        self.stats.record(((-entry[0], now - entry[2]) for entry in batch), len(batch) if one_batch else None)

    def close(self, reason: str = "the engine is closed") -> list[Any]:
        """Stop taking requests (a later ``put`` raises EngineUnavailableError(``reason``)); the
        items still waiting, for the owner to fail."""
        with self._cond:
            if self.closed is None:
                self.closed = reason
            left = [entry[4] for entry in sorted(self._heap)]
            self._heap.clear()
            self._counts.clear()
            self._cond.notify_all()
        return left
