"""The requests in flight of one link end: ``PendingTable``, the one table with deadlines.

Leaf of ``runtime.link``: standard library only. The server's requests (keyed by the client's
identity and id), the supervisor's (by request id, per replica) and a client's (by id) live in
one of these each.

    add(entry)                          -> table[key]; (deadline, seq, entry) on the heap
    claim(key) / claim_entry(entry)     -> the one answer: exactly once, whoever comes first
    expired(now)                        -> entries whose deadline passed, claimed for it
    next_deadline() / peek_deadline()   -> when to look again (peek: without the lock)
    earliest()                          -> the unclaimed entry due first, not claimed
    take_all()                          -> every unclaimed entry, claimed (failure: fail them all)

Invariants:
- An entry is claimed at most once (``Entry.claimed``, set under ``lock``): a reply, its
  deadline, a cancel and a failure race for it, and the loser finds it claimed.
- ``claim(..., keep=True)`` and ``expired(now, keep=True)`` answer an entry but leave it in the
  table until ``remove``: the server counts a request it answered at its deadline as in flight
  until the engine lets go of it.
- An answered entry's heap entry is not removed at once (a heap cannot drop one from its
  middle): ``add`` rebuilds the heap without the claimed ones once it holds more than twice
  the table (plus a slack), so the heap grows with what is in flight, not with what was answered.
- ``add_locked``/``claim_locked`` are ``add``/``claim`` for a caller that holds ``lock`` already (a
  link end that keeps its own state under the table's lock: one acquisition per request).
- ``on_enter``/``on_leave`` run under ``lock`` as an entry enters and leaves the table (counts
  kept per peer, say); keep them to a few operations.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, Callable, Generic, Mapping, TypeVar

#: claimed entries the heap may hold beyond twice the table before ``add`` drops them
_HEAP_SLACK = 64


class Entry:
    """One request in flight: its key, its deadline (monotonic seconds, or None) and whether
    something answered it already. Subclass it (with ``__slots__``) for what a link end keeps."""

    __slots__ = ("key", "deadline", "claimed")

    def __init__(self, key: Any, deadline: float | None = None) -> None:
        self.key = key
        self.deadline = deadline
        self.claimed = False


E = TypeVar("E", bound=Entry)


class PendingTable(Generic[E]):
    """Entries by key, with a deadline heap; each entry is claimed exactly once (see the module)."""

    def __init__(self, on_enter: Callable[[E], None] | None = None,
                 on_leave: Callable[[E], None] | None = None) -> None:
        self.lock = threading.Lock()
        self._entries: dict[Any, E] = {}
        #: the table itself, for ``len`` and ``in`` on a hot path without a Python call
        self.table: Mapping[Any, E] = self._entries
        self._heap: list[tuple[float, int, E]] = []
        self._seq = itertools.count()
        self._on_enter = on_enter
        self._on_leave = on_leave

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def get(self, key: Any) -> E | None:
        return self._entries.get(key)

    def add(self, entry: E) -> None:
        """``entry`` is in flight (an entry of the same key that was there is replaced: keys are unique
        by the caller's rule)."""
        with self.lock:
            self.add_locked(entry)

    def add_locked(self, entry: E) -> None:
        """``add`` for a caller holding ``lock`` (to keep its own state consistent with the table)."""
        self._entries[entry.key] = entry
        if self._on_enter is not None:
            self._on_enter(entry)
        if entry.deadline is not None:
            heap = self._heap
            if len(heap) > 2 * len(self._entries) + _HEAP_SLACK:
                self._heap = heap = [item for item in heap if not item[2].claimed]
                heapq.heapify(heap)
            heapq.heappush(heap, (entry.deadline, next(self._seq), entry))

    def claim(self, key: Any, *, keep: bool = False) -> E | None:
        """The entry of ``key`` if nothing claimed it yet (now it is claimed: its answer is the
        caller's to give); it leaves the table unless ``keep``."""
        with self.lock:
            return self.claim_locked(key, keep=keep)

    def claim_locked(self, key: Any, *, keep: bool = False) -> E | None:
        """``claim`` for a caller holding ``lock``."""
        entry = self._entries.get(key)
        if entry is None or entry.claimed:
            return None
        entry.claimed = True
        if not keep:
            self._drop(entry)
        return entry

    def claim_entry(self, entry: E, *, keep: bool = False) -> bool:
        """``claim`` for a caller that holds the entry itself: True if it is the caller's to answer."""
        with self.lock:
            if entry.claimed:
                return False
            entry.claimed = True
            if not keep:
                self._drop(entry)
            return True

    def remove(self, entry: E) -> bool:
        """``entry`` leaves the table, claimed or not (True if it was there)."""
        with self.lock:
            return self._drop(entry)

    def expired(self, now: float, *, keep: bool = False) -> list[E]:
        """The unclaimed entries whose deadline is before ``now``, claimed (leaving the table unless
        ``keep``)."""
        due: list[E] = []
        with self.lock:
            heap = self._heap
            while heap and heap[0][0] <= now:
                entry = heapq.heappop(heap)[2]
                if entry.claimed:
                    continue
                entry.claimed = True
                if not keep:
                    self._drop(entry)
                due.append(entry)
        return due

    def next_deadline(self) -> float | None:
        """The earliest deadline of an unclaimed entry, or None (drops claimed ones off the top)."""
        entry = self.earliest()
        return None if entry is None else entry.deadline

    def earliest(self) -> E | None:
        """The unclaimed entry with the earliest deadline, left unclaimed (a link end that fails every
        entry when one expires names it), or None; drops claimed ones off the top."""
        with self.lock:
            heap = self._heap
            while heap and heap[0][2].claimed:
                heapq.heappop(heap)
            return heap[0][2] if heap else None

    def peek_deadline(self) -> float | None:
        """``next_deadline`` without the lock, for a loop that looks every turn: the earliest deadline
        on the heap, which may be a claimed entry's (then ``expired`` finds nothing due and drops
        it). None when the heap is empty. (A heap read is one C call under the GIL.)"""
        heap = self._heap
        try:
            return heap[0][0]
        except IndexError:
            return None

    def take_all(self) -> list[E]:
        """Every unclaimed entry, claimed and out of the table (what a failure fails); claimed ones
        that were kept leave the table too."""
        with self.lock:
            entries = list(self._entries.values())
            for entry in entries:
                self._drop(entry)
            taken = [entry for entry in entries if not entry.claimed]
            for entry in taken:
                entry.claimed = True
            self._heap = []
        return taken

    def _drop(self, entry: E) -> bool:
        """Under ``lock``."""
        if self._entries.get(entry.key) is not entry:
            return False
        del self._entries[entry.key]
        if self._on_leave is not None:
            self._on_leave(entry)
        return True
