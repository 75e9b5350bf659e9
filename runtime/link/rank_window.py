"""RankWindow: when a local replica's requests go to its ranks (the window), and in what order (the lanes).

    submit --queue_locked--> Lanes (priority, batches) --pump_locked--> the broadcast ring
                                  ^                                        | at most ``size``
    a batch answered in full -----'  (``answered``, then ``pump_locked``)  | batches unanswered

An executing runner has at most ``size`` batches on the ring unanswered: 1 with batching (the
next batch forms while the ranks work, from everything that queued meanwhile, as a dynamic
batcher does), else 2 (the next request already waits in the ring when the ranks finish one, so
they never wait for the engine). Everything else waits in ``lanes`` (``runtime.core.lanes``:
highest priority first, FIFO within a level, batches of one key), where priority can still
order it. With batching every batch goes as a BATCH header and its requests, written together
(``BroadcastWriter.write_all``), so every rank runs the same batch. A batch waiting out its
``max_delay`` is due at ``due``: the owner's timer (the supervisor's link thread) calls
``pump_locked`` then.

A stepped runner forms its own batches: ``direct()`` switches the window off and every request
goes to the ring as it comes (priority cannot order what the runner schedules itself).

Not thread-safe: the owner calls everything under one lock (the replica's ``pending.lock``, which
also orders the ring); entries carry ``key`` (their id), ``message`` (``(data, flags)`` until
written), ``seq`` and ``batch`` (``[requests unanswered]``, shared by a batch's entries).
"""

from __future__ import annotations

from typing import Any

from runtime.core.batch_key import batch_key
from runtime.core.lanes import Lanes
from runtime.link import rank_protocol as rp
from runtime.transport import wire


class RankWindow:
    """One local replica's window and lanes (see the module)."""

    def __init__(self, max_batch_size: int = 1, max_delay_s: float = 0.0) -> None:
        self.lanes = Lanes(max_batch_size, max_delay_s, batch_key)
        #: batches the ranks may hold unanswered (None: every request at once, a stepped runner)
        self.size: int | None = 1 if max_batch_size > 1 else 2
        self.outstanding = 0  # batches on the ring not answered in full
        self.due: float | None = None  # when the next batch is due, while one waits out its delay

    def direct(self) -> None:
        """The runner forms its own batches: no window, no lanes."""
        self.size = None

    def queue_locked(self, entry: Any, request: Any, priority: int, ring: Any) -> None:
        """``entry`` (its ``message`` set) waits its turn; whatever is due goes now. Without a
        window (``direct``) it goes at once, alone."""
        if self.size is None:
            entry.seq, entry.message = ring.write(*entry.message), None
            return
        lanes = self.lanes
        if lanes.max_size == 1 and not len(lanes) and self.outstanding < self.size:  # its turn now
            lanes.stats.record(((priority, 0.0),), 1)
            self._write([entry], ring)
            return
        lanes.put(entry, request, priority)
        self.pump_locked(ring)

    def answered(self, entry: Any) -> bool:
        """``entry``'s answer came: True when that finished its batch (call ``pump_locked`` then)."""
        batch = entry.batch
        if batch is None:
            return False
        batch[0] -= 1
        if batch[0]:
            return False
        self.outstanding -= 1
        return True

    def pump_locked(self, ring: Any) -> None:
        """Write batches while the window has room and one is due."""
        lanes, size = self.lanes, self.size
        while size is not None and self.outstanding < size:
            batch = lanes.take()
            if not batch:
                self.due = lanes.due()
                return
            self._write(batch, ring)
        self.due = None

    def _write(self, batch: list[Any], ring: Any) -> None:
        messages = [entry.message for entry in batch]
        if self.lanes.max_size > 1:  # a BATCH header, even for one: the ranks call execute_batch
            messages.insert(0, (wire.pack_message(rp.BATCH, batch[0].key, count=len(batch)), 0))
        seqs = ring.write_all(messages)
        counter = [len(batch)]
        for entry, seq in zip(batch, seqs[-len(batch):]):
            entry.seq, entry.message, entry.batch = seq, None, counter
        self.outstanding += 1
