"""A link's shared memory with one peer instance (ipc:// only; see runtime.transport.protocol):
``ShmSession``, the same at both ends (the client's holder of its one session is
``runtime.link.current_session``).

Torch-free: imports ``runtime.core.errors``, ``runtime.transport`` (arena, encoder) and the register
header of ``runtime.link.client_protocol``. Both ends of the client <-> server link keep one
``ShmSession`` per peer instance: the client one with the current server instance
(``CurrentSession``), the server's ``Listener`` one per client connection (``runtime.link.peer_shm``).

    ShmSession (either end)                             the peer
    our arena:  place(n) / lend(n) -> a block; ``new``  maps it (told by a ``register`` first);
                segments are to be announced first     says when it is done with a block:
                free(blocks, mapped): done with them;  the client's ``release``, the server's
                mapped: their names go (the peer       reply or ``inputs_done``
                mapped them, a crash leaks nothing)
                hold(id, blocks) / inputs_done(id): blocks the peer still reads after its reply
    its arena:  map_peer(run_id) / admit(segment)      places blocks; sends (segment, offset, n)
                view(...): an admitted segment's block (the server: only what the client registered)
                tracked_view(...): a view whose collection queues the block in ``released``;
                take_released() -> blocks for a ``release``; give_back(blocks): not sent after all

Invariants:
- A session belongs to one peer instance: a restarted server gets a new session; ``close()`` unlinks
  and unmaps what it holds. A view outlives ``close()`` (``runtime.transport.arena`` never unmaps
  exported memory); its release, due to a session that is gone, is dropped (the peer frees what
  that session held when it drops it).
- With a ``limit`` (the server's result arena), the blocks the peer holds stay under it (``place``
  answers None beyond: frames), and ``free`` frees only blocks the peer holds (its list is not
  trusted). Our arena is used under ``_lock`` (caller and completion threads); the mapper locks
  itself; ``released`` is a deque appended to by finalizers, which may run on any thread at any
  allocation, so they take no lock.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from typing import Any, Iterable

import numpy as np

from runtime.core.errors import ProtocolError
from runtime.link.lane import LANE_BYTES, ClientLane
from runtime.transport.arena import ShmArena, ShmMapper, new_run_id

__all__ = ["MAX_RELEASE_BLOCKS", "ShmSession"]

#: a release carries at most this many blocks (the server ignores a longer list)
MAX_RELEASE_BLOCKS = 4096

_ARENA_BYTES = 8 << 20


class ShmSession:
    """One end's shared memory with one peer instance: our arena and the peer's (see the module).
    ``peer_run_id`` given: the peer's arena is known now, and only segments it ``admit``s are viewed."""

    def __init__(self, peer_run_id: str | None = None, limit: int | None = None) -> None:
        self.run_id = new_run_id()  # our arena's
        self.arena: ShmArena | None = None
        self.announced: set[str] = set()  # our segments the peer has been told of
        self.mapper: ShmMapper | None = None  # the peer's arena
        self.admitted: set[str] | None = None  # its segments we may view (None: all of its run)
        self.refused = False  # the peer refused shared memory: frames only
        self.closed = False
        #: the peer's blocks whose views were collected, for the next ``release`` (any thread appends)
        self.released: collections.deque[tuple[str, int]] = collections.deque()
        #: request id -> our blocks the peer still reads after its reply (``inputs_held``)
        self.held: dict[Any, list] = {}
        self._limit = limit
        self._outstanding: dict[tuple[str, int], int] = {}  # with a limit: our blocks the peer holds
        self._outstanding_bytes = 0
        self._unlinked: set[str] = set()
        self._lock = threading.Lock()
        self.lane: ClientLane | None = None  # the client's, over a block of ``_lane_arena``
        #: every segment registered since the lane came up went by it: submits with blocks may too
        self.registers_by_lane = True
        self._lane_arena: ShmArena | None = None
        if peer_run_id is not None:
            self.mapper = ShmMapper(peer_run_id)  # raises ValueError for a malformed run id
            self.admitted = set()

    @property
    def usable(self) -> bool:
        """The peer's arena is known and shared memory not refused: tensors may go by shared memory."""
        return not self.closed and not self.refused and self.mapper is not None

    # -- our arena -------------------------------------------------------------------------

    def place(self, nbytes: int, lend: bool = False) -> tuple[str, int, memoryview, bool] | None:
        """A block of our arena, and whether its segment is new to the peer (announce it first);
        None once closed or beyond the limit."""
        with self._lock:
            if self.closed or (self._limit is not None and self._outstanding_bytes + nbytes > self._limit):
                return None
            if self.arena is None:
                self.arena = ShmArena(self.run_id, max(_ARENA_BYTES, 2 * nbytes))
            if lend:
                segment, offset, view, _ = self.arena.lend(nbytes)
            else:
                segment, offset, view = self.arena.place(nbytes)
            if self._limit is not None:
                self._outstanding[(segment, offset)] = nbytes
                self._outstanding_bytes += nbytes
            new = segment not in self.announced
            self.announced.add(segment)
            return segment, offset, view, new

    def lend(self, nbytes: int) -> tuple[str, np.ndarray, bool] | None:
        """A lent block (``Client.empty``): (segment, the uint8 array every array over the block must
        be based on, whether the segment is new). The block goes back once that array is collected
        and every request that carried it was answered."""
        placed = self.place(nbytes, lend=True)
        if placed is None:
            return None
        segment, offset, view, new = placed
        holder = np.frombuffer(view, dtype=np.uint8)
        # let_go, not free: a finalizer may run while this thread holds the arena's lock
        weakref.finalize(holder, self.arena.let_go, segment, offset).atexit = False
        return segment, holder, new

    def borrow(self, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """The lent block a tensor at ``address`` lies in, held by one more request (None: not lent)."""
        return None if self.arena is None else self.arena.borrow(address, nbytes)

    def free(self, blocks: Iterable[tuple[str, int]], mapped: bool = False) -> None:
        """The peer is done with these blocks of ours; ``mapped``: it has mapped their segments."""
        arena = self.arena
        if arena is None:
            return
        if self._limit is None:
            for segment, offset in blocks:
                arena.free(segment, offset)  # a no-op once the arena is closed
            segments = [segment for segment, _ in blocks] if mapped else ()
        else:
            segments = []
            with self._lock:
                for key in blocks:
                    nbytes = self._outstanding.pop(key, None)
                    if nbytes is not None:  # (a peer's list is not trusted)
                        self._outstanding_bytes -= nbytes
                        arena.free(*key)
                        segments.append(key[0])
        if mapped:
            self.peer_mapped(segments)

    def peer_mapped(self, segments: Iterable[str]) -> None:
        """The peer has mapped these segments of ours: unlink their names (once each)."""
        arena = self.arena
        for segment in segments:
            if arena is None or segment in self._unlinked:
                continue
            try:
                arena.unlink(segment)
            except ValueError:  # not ours, or closed
                continue
            self._unlinked.add(segment)

    def hold(self, key: Any, blocks: list) -> None:
        """The peer still reads ``blocks`` after answering ``key``: freed at its ``inputs_done``."""
        self.held[key] = blocks

    def inputs_done(self, key: Any) -> None:
        blocks = self.held.pop(key, None)
        if blocks is not None:
            self.free(blocks)

    # -- the peer's arena ------------------------------------------------------------------

    def map_peer(self, run_id: str) -> None:
        """The peer's arena is ``run_id`` (ValueError for a malformed one)."""
        if self.mapper is None:
            self.mapper = ShmMapper(run_id)

    def admit(self, segment: str) -> None:
        """Map a segment the peer registered and unlink its name at once (a crash cannot leak it)."""
        self.mapper.view(segment, 0, 0)  # checks the name, its run, its owner; maps it
        self.admitted.add(segment)
        try:
            os.unlink(os.path.join("/dev/shm", segment))
        except FileNotFoundError:
            pass

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        """A view of the peer's block, no copy; ProtocolError for a segment it did not register."""
        if self.admitted is not None and segment not in self.admitted:
            raise ProtocolError(f"segment {segment!r} was not registered by this connection"[:300])
        if self.mapper is None:
            raise ProtocolError("a shared-memory tensor arrived before the session was registered")
        return self.mapper.view(segment, offset, nbytes)

    def tracked_view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        """``view``, whose block goes to ``released`` once the last array built over it is collected."""
        holder = np.frombuffer(self.view(segment, offset, nbytes), dtype=np.uint8)
        # the holder is the one owner of the mapped view: every array over the block is based on it
        weakref.finalize(holder, self.released.append, (segment, offset)).atexit = False
        return memoryview(holder)

    def take_released(self) -> list[list[Any]]:
        """Up to ``MAX_RELEASE_BLOCKS`` collected blocks, as a ``release`` lists them."""
        released, blocks = self.released, []
        while released and len(blocks) < MAX_RELEASE_BLOCKS:
            try:
                segment, offset = released.popleft()
            except IndexError:  # taken meanwhile
                break
            blocks.append([segment, offset])
        return blocks

    def give_back(self, blocks: list[list[Any]]) -> None:
        """Blocks ``take_released`` gave for a message that did not go out: first in line again."""
        self.released.extendleft((segment, offset) for segment, offset in reversed(blocks))

    def make_lane(self) -> ClientLane:
        """The client's lane over a segment of its own (``runtime.link.lane``; the server maps it and
        unlinks its name, ``close`` unlinks it if the server did not)."""
        self._lane_arena = ShmArena(self.run_id, LANE_BYTES)
        self.lane = ClientLane(*self._lane_arena.place(LANE_BYTES))
        return self.lane

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self.arena is not None:
                self.arena.close()
            if self.lane is not None:
                self.lane.close()
                self._lane_arena.close()
        if self.mapper is not None:
            self.mapper.close()
