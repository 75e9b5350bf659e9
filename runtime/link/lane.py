"""The same-host lane: a submit and its reply through shared memory and a pipe, past libzmq.

Torch-free; imports ``runtime.core.env`` (``PHYRT_LANE``), ``runtime.link.client_protocol`` (the
``lane`` op) and ``runtime.transport.protocol`` (``byte_view``) of the project. Over ``ipc://``
every message of a link crosses libzmq's I/O thread on each side: four thread hand-offs per round
trip, which on a 2-core machine cost a client and its server more CPU than all of phyrt's own
Python (``bench.serving``, 8 client processes). A lane takes a submit (its header and tensor
frames; blocks of shared memory while the segments were registered by the lane too), the
``register`` of a new segment of the client's arena, and any submit's final reply around them:

    client (holder of its Dealer)                       server (its I/O thread; any thread replies)
    requests ring: put(frames)  --- doorbell pipe --->  Doorbell.read(): a lane id per message;
      then write the lane's id (4 bytes)                  requests.get() once per id
    replies ring: get() once per byte  <-- reply pipe -- ServerLane.reply(frames): put, then 1 byte

Both rings lie in one block of the client's own segment (``LANE_BYTES``), which the server maps
as it maps any registered segment. The client's reply pipe lives as long as its link; the
server's doorbell as long as its listener; each side opens the other's pipe end through
``/proc/PID/fd/N`` (same user: an ``ipc://`` path sits in a 0700 directory), and checks that it is a
pipe. A lane is asked for with the ``lane`` op after ``register``; a server that refuses it (an
older one, or a ``/proc`` it cannot open) leaves the link on libzmq alone (docs/protocol.md
section 7).

Invariants:
- A ring has one writer and one reader: a client's requests are written under ``ClientLane``'s
  lock and read by the server's I/O thread; replies are written under ``ServerLane``'s lock and
  read by whoever holds the client's Dealer. Each message is announced by one pipe write *after*
  it is in the ring, and the reader takes exactly one message per announcement it read, so what it
  reads was written before (the pipe's syscalls order the memory, on any CPU).
- A pipe write never blocks and never fails for room: a ring refuses a message once
  ``max_unread`` of its messages are unread, and the pipes hold more announcements than all
  the rings can have unread (``Doorbell.max_lanes``). A message a ring refuses goes by libzmq.
- Order: only submits (not streams), registers and the submits' final replies use a lane; a submit
  has one reply. The server reads its ROUTER before the lanes and handles the lanes' messages
  first, so a ``cancel`` sent by libzmq after its submit went by the lane finds the submit. A
  segment is registered by the lane ahead of the submits that use it; after a register went by
  libzmq (the ring refused it), submits with blocks keep off the lane, which would overtake it.
- A peer that died: the write of the announcement fails (EPIPE), the lane closes, and the
  message goes by libzmq, whose failure path (a lost connection) answers it.

The same ring and pipe carry a local replica's answers, engine side (``AnswerReader``): one ring
after the slots of the replica's broadcast segment, written by its output rank (``answer_writer``,
the pipe opened through ``/proc``) and read by whichever engine thread reads the replica's answers.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
from typing import Any, Sequence

from runtime.core import env
from runtime.link.client_protocol import lane_header
from runtime.transport.protocol import byte_view

__all__ = ["ANSWERS_BYTES", "LANE_BYTES", "AnswerReader", "ClientLane", "Doorbell", "ReplyPipe", "Ring",
           "ServerLane", "answer_writer"]

#: bytes of one ring's data; a message may take at most a quarter of it
RING_BYTES = 256 << 10
_HEAD = 64  # head u64, taken u64 (the reader's); tail u64, put u64 (the writer's)
#: the block of the client's arena that holds both rings
LANE_BYTES = 2 * (_HEAD + RING_BYTES)
#: the area of one ring alone: a replica's answers (``AnswerReader``)
ANSWERS_BYTES = _HEAD + RING_BYTES
#: a client's requests unread by the server at most; then they go by libzmq
MAX_UNREAD_REQUESTS = 64
#: replies unread by the client at most (its reply pipe holds 64 KiB of announcements)
MAX_UNREAD_REPLIES = 4096
#: parts of one message at most (a header and its tensor frames)
MAX_PARTS = 257
_WRAP = 0xFFFFFFFF
_U32 = struct.Struct("<I")  # a length, a marker, a lane's id
_PAIR = struct.Struct("<QQ")  # (head, taken) or (tail, put)
_ALL = struct.Struct("<QQQQ")
_F_SETPIPE_SZ = 1031

log = logging.getLogger("phyrt.client")


class Ring:
    """One direction of a lane: a byte ring in shared memory with one writer and one reader."""

    __slots__ = ("_buf", "_base", "_data", "_max", "_max_unread")

    def __init__(self, buf: memoryview, base: int, max_unread: int) -> None:
        self._buf = buf
        self._base = base
        self._data = base + _HEAD
        self._max = RING_BYTES // 4
        self._max_unread = max_unread

    def put(self, parts: Sequence[Any]) -> bool:
        """Append one message of ``parts`` (bytes-like, C-contiguous; the writer); False when it is
        too large, the ring has no room, or a part cannot be viewed as bytes."""
        try:
            views = [p if type(p) is bytes else byte_view(p) for p in parts]
        except (TypeError, ValueError):  # not contiguous: libzmq takes it
            return False
        count = len(views)
        n = 4 + 4 * count + sum(len(v) for v in views)
        size = (4 + n + 7) & ~7
        buf, base = self._buf, self._base
        head, taken, tail, put = _ALL.unpack_from(buf, base)
        if size > self._max or put - taken >= self._max_unread:
            return False
        pos = tail % RING_BYTES
        skip = RING_BYTES - pos if RING_BYTES - pos < size else 0
        if tail + skip + size - head > RING_BYTES:
            return False
        start = self._data + pos
        if skip:  # no room before the end: a marker, and the message at the start
            _U32.pack_into(buf, start, _WRAP)
            start = self._data
        struct.pack_into(f"<{count + 2}I", buf, start, n, count, *(len(v) for v in views))
        at = start + 8 + 4 * count
        for v in views:
            buf[at:at + len(v)] = v
            at += len(v)
        _PAIR.pack_into(buf, base + 16, tail + skip + size, put + 1)  # published after its bytes
        return True

    def get(self) -> list[bytes] | None:
        """The oldest message's parts (the reader), or None when the ring is empty."""
        buf, base = self._buf, self._base
        head, taken, tail, _ = _ALL.unpack_from(buf, base)
        if head == tail:
            return None
        pos = head % RING_BYTES
        n = _U32.unpack_from(buf, self._data + pos)[0]
        if n == _WRAP:
            head += RING_BYTES - pos
            pos = 0
            n = _U32.unpack_from(buf, self._data)[0]
        start = self._data + pos
        count = _U32.unpack_from(buf, start + 4)[0] if 8 <= n <= self._max else -1
        if not 0 < count <= MAX_PARTS or 4 + 4 * count > n:
            raise ValueError(f"a lane message of {n} bytes in {count} parts: the ring is corrupt")
        sizes = struct.unpack_from(f"<{count}I", buf, start + 8)
        at, end = start + 8 + 4 * count, start + 4 + n
        parts = []
        for size in sizes:
            if at + size > end:
                raise ValueError("a lane message's parts reach past its end: the ring is corrupt")
            parts.append(bytes(buf[at:at + size]))
            at += size
        _PAIR.pack_into(buf, base, head + ((4 + n + 7) & ~7), taken + 1)
        return parts


def available() -> bool:
    """Whether lanes may be used here: ``PHYRT_LANE`` does not turn them off, and a process's pipe
    ends can be opened through ``/proc``."""
    return env.lane() and os.path.isdir("/proc/self/fd")


def open_peer_pipe(pid: int, fd: int, flags: int) -> int:
    """A new descriptor for pipe end ``fd`` of process ``pid`` (its ``/proc`` link); OSError if it
    cannot be opened or is not a pipe."""
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31 \
            or isinstance(fd, bool) or not isinstance(fd, int) or not 0 <= fd < 2**20:
        raise OSError(errno.EINVAL, f"not a process and descriptor: {pid!r}, {fd!r}")
    opened = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)
    if not stat.S_ISFIFO(os.fstat(opened).st_mode):
        os.close(opened)
        raise OSError(errno.EINVAL, f"descriptor {fd} of process {pid} is not a pipe")
    return opened


class ReplyPipe:
    """The client's pipe for reply announcements, for the life of its link: ``fd`` is polled by
    whoever reads the link; ``writer`` is the end a server opens (kept, for the next server)."""

    def __init__(self) -> None:
        self.fd, self.writer = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def count(self) -> int:
        """How many replies were announced since the last look (0: none, or the pipe is closed)."""
        try:
            return len(os.read(self.fd, 1 << 16))
        except BlockingIOError:
            return 0

    def close(self) -> None:
        _close(self.fd, self.writer)
        self.fd = self.writer = -1


class _Announcer:
    """A ring's writer and the pipe end that announces each message it takes (any thread)."""

    def __init__(self, ring: Ring, fd: int = -1, note: bytes = b"") -> None:
        self.ring = ring
        self.fd, self._note = fd, note  # -1: not (or no longer) open
        self._lock = threading.Lock()

    def attach(self, fd: int, note: bytes) -> None:
        with self._lock:
            self.fd, self._note = fd, note

    def put(self, frames: Sequence[Any]) -> bool:
        """The message in the ring and announced; False: it goes by libzmq (no room, or the pipe
        closed: a peer that died closes it here, and its message stays unannounced)."""
        with self._lock:
            if self.fd < 0 or not self.ring.put(frames):
                return False
            try:
                os.write(self.fd, self._note)
            except OSError:  # EPIPE: the reader's process is gone
                self._close_locked()
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ClientLane:
    """The client's end of one lane (one per shm session), over ``block`` at ``segment``/``offset``
    of its arena: ``ask`` for it, ``answered``, then ``send`` requests and ``take`` replies."""

    def __init__(self, segment: str, offset: int, block: memoryview) -> None:
        self._requests = _Announcer(Ring(block, 0, MAX_UNREAD_REQUESTS))  # the server's doorbell, once open
        self.replies = Ring(block, _HEAD + RING_BYTES, MAX_UNREAD_REPLIES)
        self._at = (segment, offset)
        #: a request (its header and tensor frames) in the ring and announced; False: by libzmq
        self.send = self._requests.put
        self.close = self._requests.close

    @property
    def up(self) -> bool:
        return self._requests.fd >= 0

    def ask(self, reply_fd: int) -> bytes:
        """The ``lane`` op that asks the server for this lane; ``reply_fd``: the link's reply pipe."""
        return lane_header(*self._at, reply_fd)

    def answered(self, header: dict[str, Any]) -> None:
        """The server's answer to ``lane``: up, or down for good (logged: libzmq alone)."""
        result = header.get("result")
        if header.get("ok") is not True or not isinstance(result, dict):
            log.info("no same-host lane: %s", header.get("error"))
            return
        try:
            lane = _U32.pack(result.get("lane"))  # struct.error for a bad id, before anything is opened
            self._requests.attach(open_peer_pipe(result.get("pid"), result.get("fd"), os.O_WRONLY), lane)
        except (OSError, TypeError, struct.error) as exc:
            log.info("no same-host lane: the server's doorbell cannot be opened: %s", exc)

    def take(self, count: int) -> list[list[bytes]]:
        """Up to ``count`` replies, each [header, *tensor frames] (the holder of the Dealer)."""
        out = []
        for _ in range(count):
            data = self.replies.get()
            if data is None:  # an announcement from a server instance gone since
                break
            out.append(data)
        return out


class Doorbell:
    """The server's pipe on which clients announce their lanes' requests (read by its I/O thread)."""

    def __init__(self) -> None:
        self.fd, self.writer = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:  # more announcements, more lanes (unprivileged processes may go to pipe-max-size, 1 MiB)
            size = fcntl.fcntl(self.fd, _F_SETPIPE_SZ, 1 << 20)
        except OSError:
            size = 1 << 16
        #: lanes whose unread requests the pipe can always hold
        self.max_lanes = size // (_U32.size * MAX_UNREAD_REQUESTS)
        self._carry = b""

    def read(self) -> list[int]:
        """The lane ids announced since the last read, one per message, in order."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if self._carry:
            data, self._carry = self._carry + data, b""
        whole = len(data) - len(data) % 4
        if whole != len(data):
            self._carry = data[whole:]
        return [i for (i,) in _U32.iter_unpack(data[:whole])]

    def close(self) -> None:
        _close(self.fd, self.writer)


class ServerLane:
    """The server's end of one client's lane: its requests ring (read by the I/O thread), ``reply``
    (any thread)."""

    def __init__(self, block: memoryview, pid: int, fd: int) -> None:
        self.requests = Ring(block, 0, MAX_UNREAD_REQUESTS)
        self.replies = Ring(block, _HEAD + RING_BYTES, MAX_UNREAD_REPLIES)
        self._announcer = _Announcer(self.replies, open_peer_pipe(pid, fd, os.O_WRONLY | os.O_NONBLOCK), b"\x01")

    def reply(self, frames: Sequence[Any]) -> bool:
        """The reply (its header and tensor frames) in the ring and announced; False: by libzmq."""
        return self._announcer.put(frames)

    def close(self) -> None:
        self._announcer.close()


class AnswerReader:
    """The engine's end of a replica's answer lane: its output rank's answers through a ring in the
    replica's broadcast segment (``area``, ``ANSWERS_BYTES``) and a pipe, past libzmq (``workers``
    sends a request's "done" there, unless it streamed or does not fit). The rank opens ``writer``
    through ``/proc`` (``answer_writer``); whoever reads the replica's answers polls ``fd``."""

    def __init__(self, area: memoryview) -> None:
        _ALL.pack_into(area, 0, 0, 0, 0, 0)
        self._ring = Ring(area, 0, MAX_UNREAD_REPLIES)
        self._pipe = ReplyPipe()
        self.fd, self.writer = self._pipe.fd, self._pipe.writer

    def take(self) -> list[bytes]:
        """The answers announced since the last look, in order (each one frame)."""
        out = []
        for _ in range(self._pipe.count()):
            parts = self._ring.get()
            if parts is None or len(parts) != 1:
                raise ValueError("an answer lane message that is not one frame")
            out.append(parts[0])
        return out

    def close(self) -> None:
        self._pipe.close()


def answer_writer(area: memoryview, pid: int, fd: int) -> _Announcer:
    """The output rank's end of its replica's answer lane (``AnswerReader``): ``put([frame])`` is
    False when the frame goes by libzmq (too large, no room, the engine gone)."""
    return _Announcer(Ring(area, 0, MAX_UNREAD_REPLIES), open_peer_pipe(pid, fd, os.O_WRONLY | os.O_NONBLOCK), b"\x01")


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
