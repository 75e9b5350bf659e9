"""QueueStats: how long requests waited for their replica's runner, by priority, and batch sizes.

Filled by ``runtime.core.lanes.Lanes`` as it hands out batches; read as a plain snapshot
(``ReplicaStatus.queue``, then the server's metrics page: ``phyrt_queue_wait_seconds{priority}``,
``phyrt_batch_size``). Priority labels are bounded: the first ``MAX_LEVELS`` levels seen are
kept by value, later ones are counted as "other", so a client cannot grow the label set.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Iterable

#: wait buckets (seconds): from 50 µs (taken at once) to 10 s (a saturated replica)
WAIT_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: batch-size buckets
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: priority levels labelled by value; more are "other"
MAX_LEVELS = 16


class QueueStats:
    """Counters of one replica's queue (thread-safe; ``snapshot`` copies them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._levels: dict[str, list[Any]] = {}  # label -> [count, wait sum, bucket counts]
        self._sizes = [0] * (len(SIZE_BUCKETS) + 1)
        self._batched = 0

    def record(self, waits: Iterable[tuple[int, float]], batch_size: int | None) -> None:
        """Requests taken (each ``(priority, seconds waited)``) and, for one batch, its size."""
        with self._lock:
            for priority, waited in waits:
                level = self._level(priority)
                level[0] += 1
                level[1] += waited
                level[2][bisect.bisect_left(WAIT_BUCKETS, waited)] += 1
            if batch_size is not None:
                self._sizes[bisect.bisect_left(SIZE_BUCKETS, batch_size)] += 1
                self._batched += batch_size

    def _level(self, priority: int) -> list[Any]:
        label = str(priority)
        level = self._levels.get(label)
        if level is None:
            if len(self._levels) >= MAX_LEVELS:
                label = "other"
                level = self._levels.get(label)
            if level is None:
                level = self._levels[label] = [0, 0.0, [0] * (len(WAIT_BUCKETS) + 1)]
        return level

    def snapshot(self) -> dict[str, Any]:
        """``{"levels": {label: {"count", "wait_sum_s", "wait_buckets"}}, "batches", "batched",
        "batch_size_buckets"}``; bucket lists count per bucket (not cumulative), the last one
        past the largest bound."""
        with self._lock:
            return {
                "levels": {label: {"count": c, "wait_sum_s": s, "wait_buckets": list(b)}
                           for label, (c, s, b) in self._levels.items()},
                "batches": sum(self._sizes),
                "batched": self._batched,
                "batch_size_buckets": list(self._sizes),
            }
