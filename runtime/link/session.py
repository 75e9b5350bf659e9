"""A link's shared memory with one peer instance (ipc:// only; see runtime.transport.protocol):
``ShmSession`` (own arena + the peer's result mapper + releases) and ``ShmSessions`` (the current one,
and where request tensors go).

Torch-free: imports ``runtime.core.errors``, ``runtime.transport`` (arena, encoder) and the register
header of ``runtime.link.client_protocol``. Written for the client's link (``runtime.link.link``); the
server's per-client map (``runtime.serving.shm``) is meant to adopt ``ShmSession`` later.

    Link (caller threads, under ShmSessions.lock)      server
    place(n) -> block of our arena; a new segment  -->  register [segment]  (before the
               must be registered first                 first request that uses it)
    on_registered(result) <-- {result_run_id, mapped}:  map its result arena; unlink
                                                        our names it has mapped
    result_view(segment, offset, n)               <--  results placed in its arena
      -> a view of the block; when the last array
         over it is collected, (segment, offset)
         goes to ``released``
    take_released() -> blocks for a ``release``   -->  free them; unlink a segment's name at
                                                        its first release (we mapped it)
    free(blocks): the server is done with them

    ShmSessions.encoder(session): a PayloadEncoder: a tensor of >= shm_threshold bytes lies in a
      block ``lend`` gave (Client.empty)? borrowed, sent where it lies; else placed (copied) into
      a block of the arena; no usable session: frames

Invariant: a segment new to the arena is registered with the server before any request that
uses it: its ``register`` is posted (the link's FIFO outbox) under ``ShmSessions.lock``, ahead of
every request that could carry a tensor in it.

A session belongs to one ``server_id``: a restarted server gets a new session, and
``close()`` unlinks and unmaps what this one holds. A result view outlives
``close()``: the mapping under it goes only with the last view (``runtime.transport.arena``
never unmaps exported memory), and its release, due to a session that is gone,
is dropped (the server frees what that session held when it drops it). The
caller serialises every call but ``free``, ``result_view`` and ``take_released``
(the arena and the mapper lock themselves; ``released`` is a deque, appended to by
finalizers, which may run on any thread at any allocation, so they take no lock).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import weakref
from typing import Any, Callable

import numpy as np

from runtime.core.errors import ProtocolError
from runtime.link.client_protocol import register_header
from runtime.transport.arena import ShmArena, ShmMapper, new_run_id, sweep_stale
from runtime.transport.protocol import PayloadEncoder

#: a release carries at most this many blocks (the server ignores a longer list)
MAX_RELEASE_BLOCKS = 4096

_CLIENT_ARENA_BYTES = 8 << 20


class ShmSession:
    """One server instance's shared memory on this client: our input arena, its result arena."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self.run_id = new_run_id()
        self.arena: ShmArena | None = None
        self.registered: set[str] = set()
        self.result_mapper: ShmMapper | None = None
        self.refused = False
        self.closed = False
        #: result blocks whose views were collected, for the next ``release`` (any thread appends)
        self.released: collections.deque[tuple[str, int]] = collections.deque()

    @property
    def usable(self) -> bool:
        """The server took our registration and may be sent shared-memory tensors."""
        return not self.closed and not self.refused and self.result_mapper is not None

    def place(self, nbytes: int) -> tuple[str, int, memoryview, bool]:
        """A block for a request tensor, and whether its segment is new (register it first)."""
        return self.place_with(nbytes)

    def place_with(self, nbytes: int, lend: bool = False) -> tuple[str, int, memoryview, bool]:
        if self.arena is None:
            self.arena = ShmArena(self.run_id, max(_CLIENT_ARENA_BYTES, 2 * nbytes))
        if lend:
            segment, offset, view, _ = self.arena.lend(nbytes)
        else:
            segment, offset, view = self.arena.place(nbytes)
        new = segment not in self.registered
        self.registered.add(segment)
        return segment, offset, view, new

    def lend(self, nbytes: int) -> tuple[str, int, np.ndarray, bool]:
        """A lent block of our arena (``Client.empty``): (segment, offset, the uint8 array every
        array over the block must be based on, whether the segment is new). The block goes back
        once that array is collected and every request that carried it was answered."""
        segment, offset, view, new = self.place_with(nbytes, lend=True)
        holder = np.frombuffer(view, dtype=np.uint8)
        # let_go, not free: a finalizer may run while this thread holds the arena's lock
        weakref.finalize(holder, self.arena.let_go, segment, offset).atexit = False
        return segment, offset, holder, new

    def on_registered(self, result: dict[str, Any]) -> None:
        """The server's answer to a ``register`` of this session's run id."""
        if self.result_mapper is None and isinstance(result.get("result_run_id"), str):
            self.result_mapper = ShmMapper(result["result_run_id"])
        for segment in result.get("mapped") or []:
            if self.arena is not None and segment in self.arena.segments:
                self.arena.unlink(segment)  # the server unlinked it already; this makes sure

    def free(self, blocks: list[tuple[str, int]]) -> None:
        if self.arena is not None:
            for segment, offset in blocks:
                self.arena.free(segment, offset)  # a no-op once the arena is closed

    def result_view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        """A writable view of a result block, no copy. Whatever is built over it keeps it (and
        the mapping) alive; once the last of that is collected the block goes to ``released``."""
        if self.result_mapper is None:
            raise ProtocolError("a shared-memory result arrived before this client registered")
        holder = np.frombuffer(self.result_mapper.view(segment, offset, nbytes), dtype=np.uint8)
        # the holder is the one owner of the mapped view: every array over the block is based on it
        weakref.finalize(holder, self.released.append, (segment, offset)).atexit = False
        return memoryview(holder)

    def take_released(self) -> list[list[Any]]:
        """Up to ``MAX_RELEASE_BLOCKS`` collected result blocks, as a ``release`` lists them."""
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

    def close(self) -> None:
        self.closed = True
        if self.arena is not None:
            self.arena.close()
        if self.result_mapper is not None:
            self.result_mapper.close()


class ShmSessions:
    """The session with the current server instance (``current``; None: frames only, or not yet),
    and where a request's tensors go. ``post(frames)`` queues a message ahead of later requests."""

    def __init__(self, enabled: bool, shm_threshold: int, post: Callable[[list[Any]], None]) -> None:
        self.enabled = enabled
        self.shm_threshold = shm_threshold
        self._post = post
        self.lock = threading.Lock()  # current, and its arena
        self.current: ShmSession | None = None
        self._bound: tuple[Any, Any, Any] = (None, None, None)  # (session, place, borrow), made once a session

    def wants(self) -> bool:
        """Shared memory is on and not refused, but no usable session exists (yet)."""
        session = self.current
        return self.enabled and (session is None or (not session.usable and not session.refused))

    def start(self, server_id: str) -> bytes | None:
        """A new server instance: a new session (the old one dropped before); its ``register`` to send
        at once, or None with shared memory off."""
        if not self.enabled:
            return None
        with self.lock:
            self.current = ShmSession(server_id)
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
            session.on_registered(result)
        return True

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
            if session is None or not session.usable:
                return None
            segment, offset, holder, new = session.lend(nbytes)
            if new:
                self._post([register_header(session.run_id, [segment])])
        return holder

    def _place(self, session: ShmSession, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of the arena for a request tensor."""
        with self.lock:
            if session is not self.current or not session.usable:
                return None
            segment, offset, view, new = session.place(nbytes)
            if new:
                self._post([register_header(session.run_id, [segment])])
            return segment, offset, view

    def _borrow(self, session: ShmSession, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """The lent block (``Client.empty``) a request tensor lies in, held by the request until its reply."""
        with self.lock:
            if session is not self.current or not session.usable:
                return None
            return session.arena.borrow(address, nbytes)
