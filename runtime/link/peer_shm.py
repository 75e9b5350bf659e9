"""The Listener's shared memory with its peers: ``PeerSessions``, one ``ClientShm`` per client
connection (ipc:// only; the protocol is in runtime.transport.protocol).

Torch-free; imports ``runtime.core.errors``, ``runtime.link.session`` (``ShmSession``, the mechanism
both ends share) and ``runtime.transport.arena``. What is the server's own: the per-connection map,
the checks on what a client registers, and dropping the sessions of clients that are gone.

    client                                   server I/O thread: PeerSessions
    register run_id, segments, [pid]  --->   register(): one ClientShm per connection
                                               (identity) and run id; ``admit``s each segment
                                               (mapped, then its name unlinked at once)
    submit with ext 2 refs            --->   ClientShm.view(): registered segments only
                                             engine threads: place_result(n) -> a block
    <--- result refs into our arena            of this connection's result arena
    release [[segment, offset], ...]  --->   ClientShm.release(): free; unlink each name
                                               once the client has mapped it
                                             drop_gone(): a client whose pid is gone, or
                                               idle and silent past client_timeout_s

Invariants: ``PeerSessions`` is used by the I/O thread only; a ``ClientShm``'s result arena is also
used from completion threads (``ShmSession`` locks it); its ``requests`` (the connection's requests
in flight) change under the pending table's lock. A run id belongs to one connection. A client's
unreleased result blocks hold at most ``RESULT_SHM_LIMIT`` bytes (the session's limit); beyond it,
results go as frames. Closing a session unlinks and unmaps all it holds.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

from runtime.core.errors import ProtocolError
from runtime.link.client_protocol import lane_result
from runtime.link.lane import LANE_BYTES, Doorbell, ServerLane
from runtime.link.session import ShmSession
from runtime.transport.arena import sweep_stale

log = logging.getLogger("phyrt.server")

MAX_SEGMENTS_PER_CLIENT = 64
MAX_SHM_CLIENTS = 1024
#: a client's unreleased result blocks may hold at most this much; beyond, frames
RESULT_SHM_LIMIT = 512 << 20


class ShmClientsFull(Exception):
    """``MAX_SHM_CLIENTS`` connections use shared memory already (the server answers Overloaded)."""


class ClientShm:
    """One client connection's shared memory, as the Listener keeps it: a ``ShmSession`` whose peer is
    that client (``run_id``, its arena's; our results go into ``result_run_id``'s), with the
    connection's identity, pid, last word and requests in flight."""

    __slots__ = ("identity", "run_id", "pid", "session", "result_run_id", "last_seen", "requests",
                 "register", "view", "release", "lane", "lane_id")

    def __init__(self, identity: bytes, run_id: str, pid: int | None) -> None:
        self.identity = identity
        self.run_id = run_id
        self.pid = pid  # the client's process, as it says: its state goes as soon as that is gone
        self.session = ShmSession(run_id, RESULT_SHM_LIMIT)  # raises ValueError for a malformed run id
        self.result_run_id = self.session.run_id
        self.last_seen = time.monotonic()
        self.requests = 0
        self.register = self.session.admit  # (segment): mapped, then its name unlinked
        self.view = self.session.view  # (segment, offset, nbytes): a registered segment's block
        #: (blocks, mapped): result blocks freed; ``mapped``: the client mapped their segments (unlink them)
        self.release = self.session.free
        self.lane: ServerLane | None = None  # its submits and their final replies may go here (runtime.link.lane)
        self.lane_id = -1

    def place_result(self, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of our result arena (None beyond ``RESULT_SHM_LIMIT`` or once closed: frames)."""
        placed = self.session.place(nbytes)
        return None if placed is None else placed[:3]

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        self.session.close()


class PeerSessions:
    """Every connection's ``ClientShm``, by ZMQ identity and by run id, and their lanes by id (I/O
    thread only). ``doorbell``: the lanes' announcements (a Listener on ipc:// sets it)."""

    def __init__(self) -> None:
        self._clients: dict[bytes, ClientShm] = {}
        self._run_ids: dict[str, bytes] = {}
        self.doorbell: Doorbell | None = None
        self._lanes: dict[int, ClientShm] = {}
        self._lane_ids = itertools.count()

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
        if len(client.session.admitted) + len(segments) > MAX_SEGMENTS_PER_CLIENT:
            raise ProtocolError(f"at most {MAX_SEGMENTS_PER_CLIENT} segments per connection")
        for segment in segments:
            client.register(segment)  # ProtocolError for a forged, foreign or missing name
        return client

    def open_lane(self, client: ClientShm | None, segment: str, offset: int, fd: int) -> dict[str, Any]:
        """A lane for ``client`` over its block at ``segment``/``offset`` (``runtime.link.lane``); the
        ``lane`` op's result. ProtocolError when it cannot be had; ShmClientsFull when lanes are full."""
        if self.doorbell is None or client is None or client.pid is None:
            raise ProtocolError("a lane needs ipc:// and a register with a pid first")
        if client.lane is not None:
            raise ProtocolError("this connection has a lane already")
        if len(self._lanes) >= self.doorbell.max_lanes:
            raise ShmClientsFull(f"{self.doorbell.max_lanes} clients already have a lane")
        self.register(client.identity, client.run_id, [segment], client.pid)  # as a register would
        block = client.view(segment, offset, LANE_BYTES)  # ProtocolError: past its end
        try:
            client.lane = ServerLane(block, client.pid, fd)
        except OSError as exc:
            raise ProtocolError(f"the lane's reply pipe cannot be opened: {exc}"[:300]) from None
        client.lane_id = next(self._lane_ids) % 2**32
        self._lanes[client.lane_id] = client
        return lane_result(os.getpid(), self.doorbell.writer, client.lane_id)

    def read_lanes(self) -> list[tuple[bytes, list[Any]]]:
        """The requests announced on the doorbell since the last look, as (identity, [header, *frames])."""
        out: list[tuple[bytes, list[Any]]] = []
        for lane_id in self.doorbell.read() if self._lanes else ():
            client = self._lanes.get(lane_id)
            if client is None:  # its lane closed since
                continue
            try:
                parts = client.lane.requests.get()
            except ValueError as exc:  # the client broke its own ring: no lane from now on
                log.warning("closing the lane of pid %s: %s", client.pid, exc)
                self._close_lane(client)
                continue
            if parts is not None:
                out.append((client.identity, parts))
        return out

    def _close_lane(self, client: ClientShm) -> None:
        if client.lane is not None:
            self._lanes.pop(client.lane_id, None)
            client.lane.close()
            client.lane = None

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
            self._close_lane(client)
            client.close()
        if idle:
            sweep_stale()

    def close(self) -> None:
        """Close every session. Idempotent."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._run_ids.clear()
        self._lanes.clear()
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None


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
