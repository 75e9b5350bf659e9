"""The responder end's shared memory, per peer (ipc:// only; the protocol is in runtime.transport.protocol).

Torch-free; imports only ``runtime.core.errors`` and ``runtime.transport.arena`` of the project.
``runtime.link.listener`` keeps one ``ShmSessions`` (the per-peer map); issue 33 S6 merges it with
the client's session into one ``ShmSession``.

    client                                   server I/O thread: ShmSessions
    register run_id, segments, [pid]  --->   register(): one ClientShm per connection
                                               (identity) and run id; maps each segment,
                                               then unlinks its name at once
    submit with ext 2 refs            --->   ClientShm.view(): registered segments only
                                             engine threads: place_result(n) -> a block
    <--- result refs into our arena            of this connection's result arena
    release [[segment, offset], ...]  --->   ClientShm.release(): free; unlink each name
                                               once the client has mapped it
                                             drop_gone(): a client whose pid is gone, or
                                               idle and silent past client_timeout_s

Invariants: ``ShmSessions`` is used by the I/O thread only; a ``ClientShm``'s
result arena is also used from completion threads, under its own lock; its ``requests``
(the connection's requests in flight) change under the pending table's lock. A run id
belongs to one connection. A client's unreleased result blocks hold at most
``RESULT_SHM_LIMIT`` bytes; beyond it, results go as frames. Closing a session
unlinks and unmaps all it holds.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from runtime.core.errors import ProtocolError
from runtime.transport.arena import ShmArena, ShmMapper, new_run_id, sweep_stale

log = logging.getLogger("phyrt.server")

MAX_SEGMENTS_PER_CLIENT = 64
MAX_SHM_CLIENTS = 1024
#: a client's unreleased result blocks may hold at most this much; beyond, frames
RESULT_SHM_LIMIT = 512 << 20
_RESULT_ARENA_BYTES = 8 << 20


class ShmClientsFull(Exception):
    """``MAX_SHM_CLIENTS`` connections use shared memory already (the server answers Overloaded)."""


class ClientShm:
    """The shared memory of one connection: its registered segments and our result arena."""

    def __init__(self, identity: bytes, run_id: str, pid: int | None) -> None:
        self.identity = identity
        self.run_id = run_id
        self.pid = pid  # the client's process, as it says: its state goes as soon as that is gone
        self.mapper = ShmMapper(run_id)  # raises ValueError for a malformed run id
        self.segments: set[str] = set()
        self.result_run_id = new_run_id()
        self.last_seen = time.monotonic()
        self.requests = 0
        self._lock = threading.Lock()  # the arena is used by completion threads and the I/O thread
        self._arena: ShmArena | None = None
        self._outstanding: dict[tuple[str, int], int] = {}
        self._outstanding_bytes = 0
        self._unlinked: set[str] = set()
        self._closed = False

    def register(self, segment: str) -> None:
        self.mapper.view(segment, 0, 0)  # checks the name, its run, its owner; maps it
        self.segments.add(segment)
        try:  # mapped now: the name is not needed any more, and a crash cannot leak it
            os.unlink(os.path.join("/dev/shm", segment))
        except FileNotFoundError:
            pass

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        if segment not in self.segments:
            raise ProtocolError(f"segment {segment!r} was not registered by this connection"[:300])
        return self.mapper.view(segment, offset, nbytes)

    def place_result(self, nbytes: int) -> tuple[str, int, memoryview] | None:
        with self._lock:
            if self._closed or self._outstanding_bytes + nbytes > RESULT_SHM_LIMIT:
                return None
            if self._arena is None:
                self._arena = ShmArena(self.result_run_id, max(_RESULT_ARENA_BYTES, 2 * nbytes))
            segment, offset, view = self._arena.place(nbytes)
            self._outstanding[(segment, offset)] = nbytes
            self._outstanding_bytes += nbytes
            return segment, offset, view

    def release(self, blocks: list[tuple[str, int]], mapped: bool) -> None:
        """Free result blocks; ``mapped``: the client has mapped their segments (so unlink them)."""
        with self._lock:
            for key in blocks:
                nbytes = self._outstanding.pop(key, None)
                if nbytes is None or self._arena is None:
                    continue
                self._outstanding_bytes -= nbytes
                self._arena.free(*key)
                if mapped and key[0] not in self._unlinked:
                    self._unlinked.add(key[0])
                    self._arena.unlink(key[0])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._arena is not None:
                self._arena.close()
        self.mapper.close()


class ShmSessions:
    """Every connection's ``ClientShm``, by ZMQ identity and by run id (I/O thread only)."""

    def __init__(self) -> None:
        self._clients: dict[bytes, ClientShm] = {}
        self._run_ids: dict[str, bytes] = {}

    def get(self, identity: bytes) -> ClientShm | None:
        return self._clients.get(identity)

    def register(self, identity: bytes, run_id: str, segments: list[str], pid: int | None) -> ClientShm:
        """Open (or extend) a connection's session and map ``segments``.

        ProtocolError for a message the client got wrong (a run id of another
        connection or a malformed one, too many segments, a forged, foreign or
        missing name); ShmClientsFull when no new session can be opened.
        """
        client = self._clients.get(identity)
        if client is None:
            owner = self._run_ids.get(run_id) if isinstance(run_id, str) else None
            if owner is not None:
                raise ProtocolError(f"run id {run_id!r} is registered by another connection"[:300])
            if len(self._clients) >= MAX_SHM_CLIENTS:
                raise ShmClientsFull(f"{MAX_SHM_CLIENTS} clients already use shared memory")
            try:
                client = ClientShm(identity, run_id, pid)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            self._clients[identity] = client
            self._run_ids[run_id] = identity
        elif run_id != client.run_id:
            raise ProtocolError(f"this connection registered run id {client.run_id!r}, not {run_id!r}"[:300])
        if len(client.segments) + len(segments) > MAX_SEGMENTS_PER_CLIENT:
            raise ProtocolError(f"at most {MAX_SEGMENTS_PER_CLIENT} segments per connection")
        for segment in segments:
            client.register(segment)  # ProtocolError for a forged, foreign or missing name
        return client

    def drop_gone(self, now: float, client_timeout_s: float) -> None:
        """Close the sessions of clients whose process is gone, or idle and silent too long."""
        idle = [c for c in self._clients.values()
                if (c.pid is not None and not pid_alive(c.pid))
                or (c.requests == 0 and now - c.last_seen > client_timeout_s)]
        for client in idle:
            log.info("dropping the shared memory of a client that is gone or silent (pid %s, %.0f s)",
                     client.pid, now - client.last_seen)
            del self._clients[client.identity]
            self._run_ids.pop(client.run_id, None)
            client.close()
        if idle:
            sweep_stale()

    def close(self) -> None:
        """Close every session. Idempotent."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._run_ids.clear()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
