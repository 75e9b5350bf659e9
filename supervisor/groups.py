"""What the supervisor knows about each replica group: its ranks, its pending
requests, its request arena, and the adapters that connect the arenas to the wire
codec (a thread-safe allocator that remembers what one message placed, and a
mapper whose result views give their block back when garbage-collected).
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.core.errors import EngineUnavailableError
from runtime.transport.arena import ShmArena, ShmMapper

log = logging.getLogger("phyrt.supervisor")


@dataclass
class RankState:
    replica: int
    rank: int
    device: int
    process: Any
    last_beat: float = 0.0  # enforced once the rank is ready; startup_timeout_s covers the start
    ready: bool = False
    decoder: Any = None  # the wire decoder for this rank's answers (results map to its arena)
    # under ``Reaping.lock``: whether its group's reaper released it (``process`` is a
    # ReapedProcess then, its pipes closed)
    closed: bool = False


@dataclass(frozen=True)
class ReapedProcess:
    """What is left of a rank's ``multiprocessing.Process`` once it was reaped and closed
    (its pipes released): who it was and how it ended, with the same read-only API."""

    pid: int
    name: str
    exitcode: int | None  # None: reaped by a wait outside multiprocessing, or still running after SIGKILL

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class PendingRequest:
    """A request broadcast to the ranks of a group: its future, its deadline (monotonic, or
    None), its seq on the group's ring, the request arena's blocks it placed, and, for a
    request submitted as a stream, its ``StreamCall`` (the output rank's chunks go there)."""

    __slots__ = ("future", "deadline", "seq", "blocks", "stream")

    def __init__(self, future: Future, deadline: float | None, blocks: list[tuple[str, int]],
                 stream: Any = None) -> None:
        self.future = future
        self.deadline = deadline
        self.seq = 0
        self.blocks = blocks
        self.stream = stream


@dataclass
class GroupState:
    index: int
    ranks: list[RankState]
    arena: ShmArena
    arena_lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict[int, PendingRequest] = field(default_factory=dict)
    failed: str | None = None
    frees: collections.deque = field(default_factory=collections.deque)
    # the ``runtime.link.broadcast.BroadcastWriter`` to the group's ranks (thread-safe)
    ring: Any = None
    # (seq, blocks) of answered requests whose blocks wait for every rank's release; a heap, under arena_lock
    retired: list = field(default_factory=list)
    # idle (LockedArena, wire.TensorEncoder) pairs for submits to reuse (list.pop and append are atomic)
    encoders: list = field(default_factory=list)
    # the engine's index of this replica, for messages and the ranks (``index`` counts within
    # this supervisor: a rebuilt replica is group 0 of a supervisor of its own)
    engine_replica: int = 0
    # (the request arena is closed, its names unlinked, as soon as the group fails)


class LockedArena:
    """The allocator wire.pack_message sees: thread-safe, and remembers what it placed
    (the submit takes that list after each message: a pair of these and its encoder is
    reused, one submit at a time)."""

    def __init__(self, group: GroupState) -> None:
        self._group = group
        self.placed: list[tuple[str, int]] = []

    def place(self, nbytes: int) -> tuple[str, int, memoryview]:
        with self._group.arena_lock:
            segment, offset, view = self._group.arena.place(nbytes)
        self.placed.append((segment, offset))
        return segment, offset, view

    def free(self, segment: str, offset: int) -> None:
        with self._group.arena_lock:
            self._group.arena.free(segment, offset)

    def borrow(self, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """A tensor in a block the arena lent (``Engine.empty``): sent from where it lies, the
        block held by this message until its blocks are freed (``runtime.transport.lending``)."""
        with self._group.arena_lock:
            lent = self._group.arena.borrow(address, nbytes)
        if lent is not None:
            self.placed.append(lent[:2])
        return lent


class ResultMapper:
    """Maps a rank's result segments; a decoded view frees its block when collected."""

    def __init__(self, mapper: ShmMapper, group: GroupState, rank: int) -> None:
        self._mapper, self._group, self._rank = mapper, group, rank

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        view = self._mapper.view(segment, offset, nbytes)
        holder = np.frombuffer(view, dtype=np.uint8)  # weak-referenceable owner of the view
        weakref.finalize(holder, self._group.frees.append, (self._rank, segment, offset))
        return memoryview(holder)


def lend_tensor(group: GroupState, shape: tuple[int, ...], dtype: Any) -> Any:
    """``Engine.empty`` on a local replica: a CPU tensor in a block of the group's request arena,
    lent (``runtime.transport.lending``): a request that carries it (or a contiguous slice of
    it) is sent as a reference to it, not copied. The block goes back to the arena once the
    tensor is collected and every request that carried it is answered."""
    import torch

    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with group.arena_lock:
        if group.failed is not None:
            raise EngineUnavailableError(f"replica {group.engine_replica} is not serving: {group.failed}")
        segment, offset, view, _ = group.arena.lend(nbytes)
    holder = np.frombuffer(view, dtype=np.uint8)  # every tensor over the block is based on it
    # let_go, not free: a finalizer may run in a thread that holds the arena's lock
    weakref.finalize(holder, group.arena.let_go, segment, offset).atexit = False
    return torch.frombuffer(memoryview(holder), dtype=dtype, count=count).view(shape)


def retire(group: GroupState, seq: int, blocks: list[tuple[str, int]]) -> None:
    """Under ``arena_lock``: the blocks of request ``seq`` (answered by the output rank) go back
    once every rank released it (``reclaim``)."""
    if blocks:
        heapq.heappush(group.retired, (seq, blocks))


def reclaim(group: GroupState) -> None:
    """Free the retired blocks of the requests that every rank released (the reader and the
    watch thread call it; the ring's credits tell)."""
    if not group.retired or group.ring is None:
        return
    released = group.ring.released()  # not under arena_lock: the ring's lock is its own
    with group.arena_lock:
        retired, arena = group.retired, group.arena
        while retired and retired[0][0] <= released:
            _, blocks = heapq.heappop(retired)
            for segment, offset in blocks:
                arena.free(segment, offset)
            for segment in {s for s, _ in blocks} & set(arena.segments):
                arena.unlink(segment)  # every rank has mapped it by now


def flush_rings(groups: list[GroupState]) -> bool:
    """Send what waited for the ranks' credits, and free what they released; whether a ring
    still has messages or blocks waiting for a rank (then look again soon)."""
    waiting = False
    for group in groups:
        if group.failed is not None or group.ring is None:
            continue
        if group.ring.queued and group.ring.flush():
            waiting = True
        if group.retired:
            reclaim(group)
            waiting = waiting or bool(group.retired)
    return waiting


def free_blocks(group: GroupState, blocks: list[tuple[str, int]]) -> None:
    """Give back the request arena's blocks of a message that was never sent."""
    if blocks:
        with group.arena_lock:
            for segment, offset in blocks:
                group.arena.free(segment, offset)


def recv_from_rank(sock: Any, peers: dict[bytes, tuple[GroupState, RankState]],
                   kind: str) -> tuple[GroupState, RankState, Any, int] | None:
    """Take one message off a ROUTER the ranks' DEALERs talk to (there is one: a poll said so):
    its sender's (group, rank), its first frame and its frame count, the sender's last sign of
    life noted; None (logged) when the sender is unknown."""
    identity = sock.recv()  # a ROUTER puts the sender's identity first, always
    first = last = sock.recv(copy=False)  # a Frame knows whether more follow
    count = 1
    while last.more:  # the rest of a malformed message
        last = sock.recv(copy=False)
        count += 1
    peer = peers.get(identity)
    if peer is None:
        log.warning("%s from an unknown peer %r dropped", kind, identity)
        return None
    group, r = peer
    r.last_beat = time.monotonic()
    return group, r, first, count
