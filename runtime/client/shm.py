"""A client's shared memory with one server instance (ipc:// only; see runtime.transport.protocol).

Imports only ``runtime.core.errors`` and ``runtime.transport.arena`` from the project; no torch.

    Client (caller threads, under its shm lock)        server
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
import weakref
from typing import Any

import numpy as np

from runtime.core.errors import ProtocolError
from runtime.transport.arena import ShmArena, ShmMapper, new_run_id

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
