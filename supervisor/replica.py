"""The engine end of one replica: its ranks, its requests in flight, its request arena and its ring.

    submit(request, future)   encode (tensors -> the request arena; a message larger than a ring
                              slot too); under ``pending.lock``: registered, then queued in the
                              replica's ``Lanes`` and written once to the broadcast ring
                              (``runtime.link.broadcast``: every rank reads it) when its turn comes;
                              then ``queued`` tells the owner of the reader (the supervisor)
    done(rank, msg)           the reader's: rank 0's DONE (by the answer lane, ``answers``, or the
                              ctl socket) claims its entry; PARTIAL feeds a stream
    beat(rank, payload)       a heartbeat; rank 0's may carry its runner's info (``info``)
    fail(reason)              once: ``failed`` set under ``pending.lock``, then every entry taken
    blocks                    a request's go back once rank 0 answered and every rank released it
                              on the ring (``retire``/``reclaim``); a result view's block goes back
                              through ``frees`` -> FREE on the ring once the view is collected
                              (``ResultMapper``: the ranks' result segments, mapped for decoding)

Invariants:
- The requests in flight are a ``runtime.link.pending.PendingTable`` (deadline: execution_timeout_s
  from submission). Each entry is claimed once: by rank 0's DONE, or by the replica's failure
  (an expired deadline fails the replica, ``WorkerSupervisor``); a DONE that finds no entry in
  a replica that did not fail is a protocol error.
- ``pending.lock``: the entries, ``failed`` and the ring's order (a submit registers its request
  before writing it, so its DONE cannot come first; a failed replica takes no new request).
  ``arena_lock``: the request arena and ``retired``; it may be taken under ``pending.lock``.
- A ring write never blocks: a ring without a free slot for some rank keeps the message here, in
  order, until a flush (the reader's after each poll, the watch thread's each turn) finds room.
- ``window`` (``runtime.link.rank_window``, under ``pending.lock``) decides when a request goes to the
  ring: an executing runner's wait in its lanes, by priority, in batches, a window at a time; an
  answered batch lets the next go from the thread that read the answer, a batch waiting out its
  delay goes from the link thread (``pump`` at ``window.due``). A stepped runner (rank 0's READY
  says so) gets each request as it comes.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import math
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from runtime.core.errors import EngineUnavailableError, ProtocolError
from runtime.core.futures import resolve
from runtime.link import rank_protocol as rp
from runtime.link.broadcast import FLAG_CONTROL, FLAG_SPILL, spill_ref
from runtime.link.pending import Entry, PendingTable
from runtime.link.rank_window import RankWindow
from runtime.transport import wire
from runtime.transport.arena import ShmArena, ShmMapper
from supervisor.processes import RankState

#: result blocks per "free" message (each fits a ring slot with room to spare)
FREES_PER_MESSAGE = 128


class Pending(Entry):
    """A request broadcast to the ranks: its future, its seq on the ring, the request arena's
    blocks it placed and, for a stream, its ``StreamCall`` (rank 0's chunks go there); while it
    waits its turn, its ring ``message``; once written, its ``batch`` (``[requests unanswered]``)."""

    __slots__ = ("future", "seq", "blocks", "stream", "message", "batch")

    def __init__(self, key: int, deadline: float | None, future: Any, blocks: list[tuple[str, int]],
                 stream: Any) -> None:
        super().__init__(key, deadline)
        self.future, self.seq, self.blocks, self.stream = future, 0, blocks, stream
        self.message: tuple[Any, int] | None = None
        self.batch: list[int] | None = None


class Replica:
    """One group of ranks serving one replica of the engine (see the module)."""

    def __init__(self, index: int, engine_replica: int, arena: ShmArena, timeout_s: float | None,
                 batching: tuple[int, float] = (1, 0.0),
                 queued: Callable[[Replica, Pending], None] | None = None) -> None:
        """``index`` counts within the supervisor (a rebuilt replica is group 0 of its own one),
        ``engine_replica`` within the engine; ``batching``: (max_batch_size, max_delay_s);
        ``queued(replica, entry)`` after each submit, holding no lock: the owner of the reader
        makes sure that somebody reads the answer in time (``WorkerSupervisor``)."""
        self.index, self.engine_replica = index, engine_replica
        self._queued = queued
        self.ranks: list[RankState] = []
        self.arena, self.arena_lock = arena, threading.Lock()
        self.ring: Any = None  # its ``BroadcastWriter`` (thread-safe), set right after this is kept
        self.answers: Any = None  # rank 0's answer lane (``AnswerReader``, the reader's), if it has one
        self.pending: PendingTable[Pending] = PendingTable()
        self.failed: str | None = None
        self.info: dict | None = None  # rank 0's runner info, from its latest heartbeat carrying one
        self.frees: collections.deque = collections.deque()  # (rank, segment, offset) of collected views
        self.retired: list = []  # (seq, blocks) of answered requests, a heap under arena_lock
        self.encoders: list = []  # idle (LockedArena, TensorEncoder) pairs (list.pop/append are atomic)
        self._timeout_s = timeout_s
        self._ids = itertools.count()
        self.window = RankWindow(*batching)  # under pending.lock

    def unavailable(self) -> EngineUnavailableError:
        return EngineUnavailableError(f"replica {self.engine_replica} is not serving: {self.failed or 'closed'}")

    def queue_stats(self) -> dict:
        """Its queue counters (``runtime.core.queue_stats``)."""
        return self.window.lanes.stats.snapshot()

    # -- requests ----------------------------------------------------------------------

    def submit(self, request: Any, future: Any, stream: Any = None, priority: int = 0) -> Pending:
        """Send ``request`` to the ranks when its turn comes (``window``); ``future`` gets rank 0's
        answer, ``stream`` (a ``StreamCall``) its chunks before that. Raises EngineUnavailableError
        once failed."""
        if self.failed is not None:
            raise self.unavailable()
        request_id = next(self._ids)
        payload, placed, flags = self._encode(request_id, request, stream is not None)
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        entry = Pending(request_id, deadline, future, placed, stream)
        table = self.pending
        with table.lock:
            if self.failed is not None:
                self.free_blocks(placed)
                raise self.unavailable()
            table.add_locked(entry)
            entry.message = (payload, flags)
            self.window.queue_locked(entry, request, priority, self.ring)
        if stream is not None:
            stream.bind_cancel(functools.partial(self.cancel, request_id))
        if self._queued is not None:
            self._queued(self, entry)
        return entry

    def stepped(self, stepped: Any) -> None:
        """Rank 0's READY: whether its runner forms its own batches (then no window)."""
        if stepped is True:
            self.window.direct()

    def answered(self, entry: Pending) -> None:
        """``entry``'s answer was taken (the reader's): the last of its batch lets the next go."""
        if entry.batch is not None:
            with self.pending.lock:
                if self.window.answered(entry) and self.failed is None:
                    self.window.pump_locked(self.ring)

    def pump(self) -> float | None:
        """The link thread's, at ``window.due``: write the batches due; when the next one is."""
        with self.pending.lock:
            if self.failed is None:
                self.window.pump_locked(self.ring)
            return self.window.due

    def cancel(self, request_id: int) -> None:
        """A stream's cancel hook: CANCEL on the ring, behind its request, while it is in flight."""
        message = wire.pack_message(rp.CANCEL, request_id)
        with self.pending.lock:
            if self.failed is None and request_id in self.pending.table:
                self.ring.write(message)

    def _encode(self, request_id: int, request: Any, stream: bool) -> tuple[Any, list[tuple[str, int]], int]:
        """The message (or, larger than a ring slot, a reference to its copy in the request arena),
        the arena blocks it placed, and its ring flags."""
        try:  # an idle encoder; each concurrent caller makes one the first time
            allocator, encoder = self.encoders.pop()
        except IndexError:
            allocator = LockedArena(self)
            encoder = wire.TensorEncoder(allocator=allocator)
        flags, placed = 0, []
        try:
            if stream:
                payload = wire.pack_message(rp.REQUEST, request_id, payload=request, stream=True,
                                            tensor_encoder=encoder)
            else:
                payload = wire.pack_message(rp.REQUEST, request_id, payload=request, tensor_encoder=encoder)
            placed, allocator.placed = allocator.placed, []
            if len(payload) > self.ring.max_bytes:  # spilled: the ranks copy it out of the arena
                segment, offset, view = allocator.place(len(payload))
                placed.append((segment, offset))
                view[:] = payload
                payload, flags = spill_ref(segment, offset, len(payload)), FLAG_SPILL
        except Exception:
            self.free_blocks(placed)  # what the message placed (pack_message frees its own when it raises)
            if self.failed is None:
                raise
            raise self.unavailable() from None  # failed meanwhile: its arena is closed
        finally:
            allocator.placed = []
            self.encoders.append((allocator, encoder))
        return payload, placed, flags

    # -- what the ranks send -----------------------------------------------------------------

    def done(self, r: RankState, msg: dict[str, Any]) -> Pending | None:
        """Rank 0's successful DONE: its entry, claimed (None: the replica failed meanwhile)."""
        if r.rank != 0:
            raise ProtocolError(f"rank {r.rank} answered request {msg['id']!r}: only the output rank answers")
        entry = self.pending.claim(msg["id"])
        if entry is None and self.failed is None:  # (failed is set before a failure takes the entries)
            raise ProtocolError(f"answer to unknown request {msg['id']!r}")
        return entry

    def stream_of(self, r: RankState, msg: dict[str, Any]) -> Any:
        """The ``StreamCall`` a PARTIAL's chunk goes to."""
        entry = self.pending.get(msg["id"])
        if r.rank != 0 or entry is None or entry.claimed or entry.stream is None:
            raise ProtocolError(f"rank {r.rank} sent a chunk of request {msg['id']!r}, not a stream "
                                "of its output rank in flight")
        return entry.stream

    def beat(self, r: RankState, payload: Any) -> None:
        """A heartbeat: HB {id: count} and, from rank 0 only, an optional ``info`` dict (kept)."""
        msg = wire.unpack_message(payload, expected_types=rp.BEATS)
        info = msg.get("info")
        if not isinstance(msg["id"], int) or not (info is None or isinstance(info, dict) and r.rank == 0):
            raise ProtocolError(f"a heartbeat needs a count and, from rank 0 only, an info dict: {msg!r}"[:300])
        if info is not None:
            self.info = info  # a fresh dict each time: readers see the old one or the new one

    # -- failing -------------------------------------------------------------------------

    def fail(self, reason: str) -> list[Pending] | None:
        """Stop serving with ``reason`` (once: None if it had stopped already); the entries taken,
        for the caller to fail. The request arena closes: no rank reads this replica's requests again."""
        if not self._stop(reason):
            return None
        self.window.lanes.close(reason)
        taken = self.pending.take_all()
        with self.arena_lock:
            self.arena.close()  # its names go now (a growth segment of a request in flight included)
        return taken

    def close(self, reason: str) -> tuple[bool, list[Pending]]:
        """close(): whether it was serving until now, and the entries taken."""
        serving = self._stop(reason)
        self.window.lanes.close(reason)
        return serving, self.pending.take_all()

    def _stop(self, reason: str) -> bool:
        with self.pending.lock:
            if self.failed is not None:
                return False
            self.failed = reason
            return True

    # -- blocks -------------------------------------------------------------------------

    def lend(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """``Engine.empty``: a CPU tensor in a block of the request arena, lent
        (``runtime.transport.lending``): a request carrying it is sent as a reference, not copied;
        the block goes back once the tensor is collected and every request carrying it answered."""
        import torch

        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self.arena_lock:
            if self.failed is not None:
                raise self.unavailable()
            segment, offset, view, _ = self.arena.lend(nbytes)
        holder = np.frombuffer(view, dtype=np.uint8)  # every tensor over the block is based on it
        # let_go, not free: a finalizer may run in a thread that holds the arena's lock
        weakref.finalize(holder, self.arena.let_go, segment, offset).atexit = False
        return torch.frombuffer(memoryview(holder), dtype=dtype, count=count).view(shape)

    def retire(self, entry: Pending) -> None:
        """Rank 0 answered ``entry``: its blocks go back once every rank released it (``reclaim``).
        Takes ``arena_lock`` even when it placed nothing (uncontended, next to free; and
        test_kill_matrix stalls the reader through it, to open a race on purpose)."""
        with self.arena_lock:
            if entry.blocks:
                heapq.heappush(self.retired, (entry.seq, entry.blocks))
        if self.retired:
            self.reclaim()

    def reclaim(self) -> None:
        """Free the retired blocks of the requests every rank released (the ring's credits tell)."""
        if not self.retired or self.ring is None:
            return
        released = self.ring.released()  # not under arena_lock: the ring's lock is its own
        with self.arena_lock:
            retired, arena = self.retired, self.arena
            while retired and retired[0][0] <= released:
                _, blocks = heapq.heappop(retired)
                for segment, offset in blocks:
                    arena.free(segment, offset)
                for segment in {s for s, _ in blocks} & set(arena.segments):
                    arena.unlink(segment)  # every rank has mapped it by now

    def flush(self) -> bool:
        """Send what waited for the ranks' credits, free what they released; whether something
        still waits for a rank (then look again soon)."""
        if self.failed is not None or self.ring is None:
            return False
        waiting = bool(self.ring.queued and self.ring.flush())
        if self.retired:
            self.reclaim()
            waiting = waiting or bool(self.retired)
        return waiting

    def free_blocks(self, blocks: list[tuple[str, int]]) -> None:
        """Give back the request arena's blocks of a message that was never sent."""
        if blocks:
            with self.arena_lock:
                for segment, offset in blocks:
                    self.arena.free(segment, offset)

    def send_frees(self) -> None:
        """The result blocks whose views were collected, back to rank 0 (the reader's)."""
        blocks = []
        while self.frees:
            _, segment, offset = self.frees.popleft()  # rank 0's: only it has a result arena
            blocks.append([segment, offset])
        if self.failed is None:
            for start in range(0, len(blocks), FREES_PER_MESSAGE):  # each fits a ring slot
                self.ring.write(wire.pack_message(rp.FREE, 0, blocks=blocks[start:start + FREES_PER_MESSAGE]),
                                FLAG_CONTROL)

    def send_shutdown(self) -> None:
        """The ring's last message; closing the ring lets it overtake the requests still queued."""
        if self.ring is not None:  # (None: the start failed before the replica had one)
            self.ring.write(wire.pack_message(rp.SHUTDOWN, 0), FLAG_CONTROL)
            self.ring.close()


def fail_futures(entries: list[Pending], message: str, cause: BaseException | None) -> None:
    for entry in entries:
        error = EngineUnavailableError(message)
        error.__cause__ = cause
        resolve(entry.future, error=error)


class LockedArena:
    """The allocator ``wire.pack_message`` sees: thread-safe, and remembers what it placed (the
    submit takes that list after each message; a pair of these and its encoder serves one submit
    at a time)."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica
        self.placed: list[tuple[str, int]] = []

    def place(self, nbytes: int) -> tuple[str, int, memoryview]:
        with self._replica.arena_lock:
            segment, offset, view = self._replica.arena.place(nbytes)
        self.placed.append((segment, offset))
        return segment, offset, view

    def free(self, segment: str, offset: int) -> None:
        with self._replica.arena_lock:
            self._replica.arena.free(segment, offset)

    def borrow(self, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """A tensor in a block the arena lent (``Engine.empty``): sent from where it lies, the block
        held by this message until its blocks are freed (``runtime.transport.lending``)."""
        with self._replica.arena_lock:
            lent = self._replica.arena.borrow(address, nbytes)
        if lent is not None:
            self.placed.append(lent[:2])
        return lent


class ResultMapper:
    """Maps a rank's result segments; a decoded view frees its block when collected."""

    def __init__(self, mapper: ShmMapper, replica: Replica, rank: int) -> None:
        self._mapper, self._frees, self._rank = mapper, replica.frees, rank

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        view = self._mapper.view(segment, offset, nbytes)
        holder = np.frombuffer(view, dtype=np.uint8)  # weak-referenceable owner of the view
        weakref.finalize(holder, self._frees.append, (self._rank, segment, offset))
        return memoryview(holder)
