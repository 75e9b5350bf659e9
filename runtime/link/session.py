"""A link's shared memory with one peer instance (ipc:// only; see runtime.transport.protocol):
``ShmSession``, the same at both ends, and ``CurrentSession``, the client's holder of its one session.

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

    client: CurrentSession                             server
    start(server_id) -> register [run_id]         -->  a ShmSession for this connection
    registered(reply) <-- {result_run_id, mapped}:     map_peer; free the names it mapped
    encoder(session): a PayloadEncoder: a tensor of >= shm_threshold bytes lies in a block ``lend``
      gave (Client.empty)? borrowed, sent where it lies; else placed (copied) into a block of the
      arena, a new segment registered first; no usable session: frames

Invariants:
- A segment new to the client's arena is registered with the server before any request that uses
  it: its ``register`` is posted (the link's FIFO outbox) under ``CurrentSession.lock``, ahead of
  every request that could carry a tensor in it.
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
import functools
import os
import threading
import weakref
from typing import Any, Callable, Iterable

import numpy as np

from runtime.core.errors import ProtocolError
from runtime.link.client_protocol import register_header
from runtime.link.lane import LANE_BYTES, ClientLane, ReplyPipe
from runtime.link.lane import available as lanes_available
from runtime.transport.arena import ShmArena, ShmMapper, new_run_id, sweep_stale
from runtime.transport.protocol import PayloadEncoder

__all__ = ["MAX_RELEASE_BLOCKS", "CurrentSession", "ShmSession"]

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


class CurrentSession:
    """The client's session with the current server instance (``current``; None: frames only, or not
    yet), and where a request's tensors go. ``post(frames)`` queues a message ahead of later requests."""

    def __init__(self, enabled: bool, shm_threshold: int, post: Callable[[list[Any]], None]) -> None:
        self.enabled = enabled
        self.shm_threshold = shm_threshold
        self._post = post
        self.lock = threading.Lock()  # current, and what is announced of its arena
        self.current: ShmSession | None = None
        self._bound: tuple[Any, Any, Any] = (None, None, None)  # (session, place, borrow), made once a session
        #: the link's reply pipe, for the lanes of its sessions (None: no lanes)
        self.replies = ReplyPipe() if enabled and lanes_available() else None

    @property
    def lane(self) -> ClientLane | None:
        """The current session's lane, once the server accepted it (requests may go by it)."""
        session = self.current
        lane = None if session is None else session.lane
        return lane if lane is not None and lane.up else None

    @property
    def reply_lane(self) -> ClientLane | None:
        """The current session's lane, accepted or not: the server may reply by it before its answer
        to ``lane`` is read."""
        session = self.current
        return None if session is None else session.lane

    def wants(self) -> bool:
        """Shared memory is on and not refused, but no usable session exists (yet)."""
        session = self.current
        return self.enabled and (session is None or (not session.usable and not session.refused))

    def start(self, server_id: str) -> bytes | None:
        """A new server instance (``server_id``): a new session (the old one dropped before); its
        ``register`` to send at once, or None with shared memory off."""
        if not self.enabled:
            return None
        with self.lock:
            self.current = ShmSession()
            return register_header(self.current.run_id, [], pid=os.getpid())

    def registered(self, header: dict[str, Any]) -> bool:
        """The server's answer to a ``register``; False if it refused shared memory (frames from now on)."""
        result = header.get("result")
        with self.lock:
            session = self.current
            if session is None or not isinstance(result, dict) or result.get("run_id") != session.run_id:
                if session is not None and header.get("ok") is not True:
                    session.refused = True
                    return False
                return True
            if isinstance(result.get("result_run_id"), str):
                session.map_peer(result["result_run_id"])
            session.peer_mapped(result.get("mapped") or [])  # unlinked by the server already; making sure
        return True

    def lane_request(self) -> bytes | None:
        """After a successful register: the ``lane`` op, over a new segment of the current session
        (None: no lanes, or no session)."""
        with self.lock:
            session = self.current
            if self.replies is None or session is None or not session.usable or session.lane is not None:
                return None
            return session.make_lane().ask(self.replies.writer)

    def lane_opened(self, header: dict[str, Any]) -> None:
        """The server's answer to ``lane``: the lane is up, or it stays down (libzmq alone)."""
        session = self.current
        if session is not None and session.lane is not None:
            session.lane.answered(header)

    def close(self) -> None:
        """The link is closed and nobody reads it: close the reply pipe."""
        if self.replies is not None:
            self.replies.close()

    def drop(self, swept: bool = False) -> None:
        """Close the current session (its views stay valid); ``swept``: also sweep the names a killed
        server left."""
        with self.lock:
            session, self.current = self.current, None
        if session is not None:
            session.close()
            if swept:
                sweep_stale()

    def encoder(self, session: ShmSession | None) -> PayloadEncoder:
        """An encoder for one request over ``session`` (None: frames only). Its frames view the
        caller's arrays: the link sends them at once (zmq copies them), or snapshots them."""
        if session is None:
            return PayloadEncoder(copy=False, shm_threshold=self.shm_threshold)
        bound, place, borrow = self._bound
        if bound is not session or (borrow is None and session.arena is not None):
            place = functools.partial(self._place, session)
            borrow = functools.partial(self._borrow, session) if session.arena is not None else None
            self._bound = (session, place, borrow)  # one tuple: threads racing here build the same
        return PayloadEncoder(copy=False, place=place, shm_threshold=self.shm_threshold, borrow=borrow)

    def lend(self, nbytes: int) -> np.ndarray | None:
        """A lent block of the current session's arena (``Client.empty``); None without a usable session."""
        with self.lock:
            session = self.current
            lent = session.lend(nbytes) if session is not None and session.usable else None
            if lent is None:
                return None
            segment, holder, new = lent
            if new:
                self._announce(session, segment)
        return holder

    def _place(self, session: ShmSession, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of the arena for a request tensor."""
        with self.lock:
            placed = session.place(nbytes) if session is self.current and session.usable else None
            if placed is None:
                return None
            segment, offset, view, new = placed
            if new:
                self._announce(session, segment)
            return segment, offset, view

    def _announce(self, session: ShmSession, segment: str) -> None:
        """Under ``lock``: register a new segment ahead of every request that may use it, by the lane
        when it is up (the server handles the lane's messages in order), else by libzmq (the
        outbox); after one by libzmq, requests with blocks keep off the lane (which the server
        reads first)."""
        frames = [register_header(session.run_id, [segment])]
        lane = session.lane
        if lane is not None and lane.up and session.registers_by_lane and lane.send(frames):
            return
        session.registers_by_lane = False
        self._post(frames)

    def _borrow(self, session: ShmSession, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """The lent block (``Client.empty``) a request tensor lies in, held by the request until its reply."""
        with self.lock:
            if session is not self.current or not session.usable:
                return None
            return session.borrow(address, nbytes)
