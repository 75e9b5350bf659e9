"""The broadcast ring: one writer (the engine, per replica), N readers (the replica's ranks), one
shared-memory segment. Every reader reads every message, in the order written.

Torch-free; imports only ``runtime.core`` and ``runtime.transport`` of the project.

    engine: BroadcastWriter                          rank r: BroadcastReader(index r)
    creates /dev/shm/phyrt-<run>-<pid>-<seq>         maps it (name and nonce from its boot message)
    write(data) -> seq, never blocks:                recv(): wait filled[r] (spin, then sem_timedwait
      a credit of every reader (trywait free[r]),       slices, looking at ``closing`` between them)
      the slot written, post filled[r] for every r     -> (seq, flags, bytes copied out of the slot)
      no credit of some reader: queued here;         release(seq): done with message seq (and with
      flush() retries (each answer, each tick)          what it refers to): post free[r]
    released(): every reader released through it
    unlink() once every reader mapped it; close(): ``closing`` set, a post to every reader

Layout: a 4 KiB header: for reader r, ``filled[r]`` at ``2r * SEM_STRIDE``, ``free[r]`` at
``(2r + 1) * SEM_STRIDE``, its ``released`` u64 at ``RELEASED_AT + 64 r``; then the geometry
(nonce, readers, slots, slot bytes, writer pid) and the ``closing`` flag. The slots follow:
``[u64 seq | u32 len | u32 flags | bytes]``, message seq (from 1) in slot ``(seq - 1) % slots``.
Last, the writer's ``answer_bytes`` (``answers`` on either end): the area of the replica's answer
lane (``runtime.link.lane.AnswerReader``), which the ring itself never touches.

Invariants:
- Only the semaphores order memory: the writer fills a slot, then posts; a reader that took the
  post reads it. A reader's ``release`` posts ``free[r]`` once per message, in order, so the
  writer counts what each reader released from the credits it took (``released()``): the
  ``released`` u64s in the header are for inspection only.
- The writer never blocks: a dead or slow reader makes its messages queue in this process; the
  supervisor's death watch, not the ring, fails the group.
- Names as the arenas' (``runtime.transport.shm_names``): a writer killed before ``unlink``
  leaves a name the sweeps remove. Ranks die with their engine, so readers check no liveness.
- A message larger than ``max_bytes`` is the caller's to spill (``spill_ref``: a block of a
  shared-memory arena holds it; ``FLAG_SPILL``); the reader copies it out.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from typing import Any

from runtime.core.errors import ProtocolError
from runtime.transport.semaphores import SEM_STRIDE, Timespec, semaphores, timed_wait
from runtime.transport.shm_names import NAME_RE, SHM_DIR, check_run_id, unlink_quiet
from runtime.transport.spin import Spinner

__all__ = ["BroadcastReader", "BroadcastWriter", "CLOSED", "FLAG_CONTROL", "FLAG_SPILL", "spill_ref"]

HEADER_BYTES = 4096
MAX_READERS = 16
RELEASED_AT = 2 * MAX_READERS * SEM_STRIDE
_GEOMETRY_AT = RELEASED_AT + MAX_READERS * 64
_GEOMETRY = struct.Struct("<16sIIII")  # nonce, readers, slots, slot bytes, writer pid
_CLOSING_AT = _GEOMETRY_AT + 64
_HEAD = struct.Struct("<QII")  # a slot's seq, length, flags
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_SPILL = struct.Struct("<QQ")  # offset, nbytes; the segment's name follows
#: flags of a message: a control message (the rank reads it as such); a spilled message
FLAG_CONTROL, FLAG_SPILL = 1, 2
#: how long a waiting reader sleeps before it looks at ``closing`` again
POLL_S = 0.1
#: what ``recv`` returns once the writer closed the ring
CLOSED = "closed"
#: segment numbers, apart from the arenas' and the collectives' (one pid's names never meet)
segment_seq = itertools.count(1 << 34)


def spill_ref(segment: str, offset: int, nbytes: int) -> bytes:
    """The slot's content for a message spilled into ``segment`` (write it with ``FLAG_SPILL``)."""
    return _SPILL.pack(offset, nbytes) + segment.encode()


def _create(run_id: str, size: int) -> tuple[str, mmap.mmap]:
    for _ in range(64):
        name = f"phyrt-{run_id}-{os.getpid()}-{next(segment_seq)}"
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"could not create a fresh segment name for run {run_id}")
    try:
        os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not with a SIGBUS later
        return name, mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink_quiet(name)
        raise
    finally:
        os.close(fd)


class _Ring:
    """What writer and reader share: the mapping, its semaphores' addresses, the slot geometry."""

    def __init__(self, mm: mmap.mmap, readers: int, slots: int, slot_bytes: int) -> None:
        lib = semaphores()
        self._mm, self.readers, self.slots, self.slot_bytes = mm, readers, slots, slot_bytes
        self._post, self._trywait, self._timedwait = lib.sem_post, lib.sem_trywait, lib.sem_timedwait
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping while semaphores point into it
        base = ctypes.addressof(self._anchor)
        self._filled = [ctypes.c_void_p(base + 2 * r * SEM_STRIDE) for r in range(readers)]
        self._free = [ctypes.c_void_p(base + (2 * r + 1) * SEM_STRIDE) for r in range(readers)]
        self._stride = _HEAD.size + slot_bytes
        end = HEADER_BYTES + slots * self._stride
        #: the bytes past the slots (the replica's answer lane, ``runtime.link.lane``), or None
        self.answers = memoryview(mm)[end:] if len(mm) > end else None

    def _slot(self, seq: int) -> int:
        return HEADER_BYTES + ((seq - 1) % self.slots) * self._stride

    def _unmap(self) -> None:
        self._filled = self._free = []
        answers, self._anchor, self.answers = self.answers, None, None
        if answers is not None:
            try:
                answers.release()  # whoever still holds it (the answer lane) can no longer use it
            except BufferError:  # in use this very moment: the mapping goes with the last view
                pass
        try:
            self._mm.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass


class BroadcastWriter(_Ring):
    """The engine's end (one per replica): ``write`` never blocks; thread-safe."""

    def __init__(self, run_id: str, readers: int, slots: int = 256, slot_bytes: int = 16 << 10,
                 answer_bytes: int = 0) -> None:
        check_run_id(run_id)
        if semaphores() is None:
            raise OSError("the C library has no sem_* functions: the broadcast ring needs them")
        if not 1 <= readers <= MAX_READERS or slots < 1 or slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"1..{MAX_READERS} readers, >= 1 slot and a multiple of 64 bytes >= 64 a slot; "
                             f"got {readers}, {slots}, {slot_bytes}")
        self.name, mm = _create(run_id, HEADER_BYTES + slots * (_HEAD.size + slot_bytes) + answer_bytes)
        self._linked = True
        self.nonce = secrets.token_bytes(16)
        try:
            super().__init__(mm, readers, slots, slot_bytes)
            lib = semaphores()
            for r in range(readers):
                if lib.sem_init(self._filled[r], 1, 0) != 0 or lib.sem_init(self._free[r], 1, slots) != 0:
                    raise OSError(ctypes.get_errno(), "sem_init of the broadcast ring")
            _GEOMETRY.pack_into(mm, _GEOMETRY_AT, self.nonce, readers, slots, slot_bytes, os.getpid())
        except BaseException:
            self.unlink()
            mm.close()
            raise
        self._lock = threading.Lock()
        self._seq = 0  # the last seq handed out
        self._queue: collections.deque[tuple[int, bytes, int]] = collections.deque()
        self._held = [0] * readers  # credits taken and not used yet
        self._taken = [0] * readers  # every credit ever taken, per reader
        self.closed = False

    @property
    def max_bytes(self) -> int:
        """The largest message a slot holds; larger ones are the caller's to spill."""
        return self.slot_bytes

    @property
    def queued(self) -> int:
        """Messages written that wait for a reader's credit (``flush`` sends them)."""
        return len(self._queue)

    def write(self, data: bytes, flags: int = 0) -> int:
        """Put ``data`` in the ring for every reader (or queue it, if some reader has no free
        slot); its seq. Never blocks. Nothing is written once the ring is closed."""
        return self.write_all(((data, flags),))[0]

    def write_all(self, messages: Any) -> list[int]:
        """``write`` each ``(data, flags)`` of ``messages`` with no other writer's message among
        them (a batch and its requests); their seqs."""
        for data, _ in messages:
            if len(data) > self.slot_bytes:
                raise ValueError(f"a message of {len(data)} bytes does not fit a slot of {self.slot_bytes}: spill it")
        seqs = []
        with self._lock:
            for data, flags in messages:
                self._seq += 1
                if not self.closed and (self._queue or not self._put(self._seq, data, flags)):
                    self._queue.append((self._seq, bytes(data), flags))
                seqs.append(self._seq)
        return seqs

    def flush(self) -> int:
        """Write what waited for credits, in order, as far as credits allow; how many still wait."""
        if not self._queue:
            return 0
        with self._lock:
            queue = self._queue
            while queue and not self.closed and self._put(*queue[0]):
                queue.popleft()
            return len(queue)

    def _put(self, seq: int, data: bytes, flags: int) -> bool:
        held, taken, trywait = self._held, self._taken, self._trywait
        for r in range(self.readers):
            if not held[r]:
                if trywait(self._free[r]) != 0:
                    return False
                held[r] = 1
                taken[r] += 1
        for r in range(self.readers):
            held[r] -= 1
        at = self._slot(seq)
        _HEAD.pack_into(self._mm, at, seq, len(data), flags)
        self._mm[at + _HEAD.size:at + _HEAD.size + len(data)] = data
        for sem in self._filled:
            self._post(sem)
        return True

    def released(self) -> int:
        """The seq through which every reader released its messages (each ``release`` posts one
        credit, in order: the credits taken beyond the first ``slots`` count them)."""
        with self._lock:
            if self.closed:
                return 0
            trywait, least = self._trywait, None
            for r in range(self.readers):
                while trywait(self._free[r]) == 0:
                    self._held[r] += 1
                    self._taken[r] += 1
                done = self._taken[r] - self.slots
                least = done if least is None or done < least else least
            return max(0, least)

    def unlink(self) -> None:
        """Remove the name (every reader mapped it); the mappings stay."""
        if self._linked:
            self._linked = False
            unlink_quiet(self.name)

    def close(self) -> None:
        """Set ``closing`` and wake every reader (each ``recv`` returns ``CLOSED`` from now on, ahead
        of the messages still in the ring); unlink and unmap. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._queue.clear()
            _U32.pack_into(self._mm, _CLOSING_AT, 1)
            for sem in self._filled:
                self._post(sem)
            self.unlink()
            self._unmap()


class BroadcastReader(_Ring):
    """Reader ``index``'s end (a rank), used by one thread. ``mapper`` (a ``ShmMapper`` of the run)
    reads spilled messages."""

    def __init__(self, run_id: str, name: str, index: int, nonce: bytes, *, spin_ns: int = 0,
                 mapper: Any = None) -> None:
        match = NAME_RE.fullmatch(name) if isinstance(name, str) else None
        if match is None or match.group(1) != check_run_id(run_id):
            raise ProtocolError(f"{name!r} is not a segment name of run {run_id}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size <= HEADER_BYTES:
                raise ProtocolError(f"segment {name!r} is not a broadcast ring of this user")
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        got, readers, slots, slot_bytes, _ = _GEOMETRY.unpack_from(mm, _GEOMETRY_AT)
        if got != nonce or not 0 <= index < readers or HEADER_BYTES + slots * (_HEAD.size + slot_bytes) > len(mm):
            mm.close()
            raise ProtocolError(f"segment {name!r} is not the broadcast ring this reader was given")
        super().__init__(mm, readers, slots, slot_bytes)
        self.index, self._mapper = index, mapper
        self._mine, self._room = self._filled[index], self._free[index]
        self._next = 1  # the seq of the next message
        self._released = 0
        self._spinner = Spinner(spin_ns)
        self._when = Timespec()
        self.closed = False

    def recv(self, timeout: float | None = None, spin: bool = False) -> tuple[int, int, bytes] | str | None:
        """The next message as (seq, flags, bytes), ``CLOSED`` once the writer closed the ring, None
        after ``timeout`` seconds (0: look only; None: wait for one). ``spin``: poll a moment first,
        as ``runtime.transport.spin`` decides."""
        if self.closed:
            return CLOSED
        trywait, sem = self._trywait, self._mine
        if trywait(sem) != 0:
            if timeout == 0:
                return None
            if spin:
                got = self._spinner.wait(lambda: trywait(sem) == 0, self._sleep, timeout)
            else:
                got = self._sleep(timeout)
            if not got:
                return CLOSED if self.closed else None
        if _U32.unpack_from(self._mm, _CLOSING_AT)[0]:
            self.closed = True
            return CLOSED
        at = self._slot(self._next)
        seq, length, flags = _HEAD.unpack_from(self._mm, at)
        if seq != self._next or length > self.slot_bytes:
            raise ProtocolError(f"broadcast ring: slot of message {self._next} holds {seq} ({length} bytes)")
        data = self._mm[at + _HEAD.size:at + _HEAD.size + length]
        if flags & FLAG_SPILL:
            offset, nbytes = _SPILL.unpack_from(data)
            data = bytes(self._mapper.view(data[_SPILL.size:].decode(), offset, nbytes))
        self._next += 1
        return seq, flags, data

    def _sleep(self, timeout: float | None) -> bool:
        """Wait for a message in ``POLL_S`` slices; False after ``timeout`` or once ``closing`` shows."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if _U32.unpack_from(self._mm, _CLOSING_AT)[0]:
                self.closed = True
                return False
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            if timed_wait(self._timedwait, self._mine, self._when, left):
                return True

    def release(self, seq: int) -> None:
        """Done with message ``seq`` and with what it refers to (its request's arena blocks):
        every message is released once, in order."""
        if seq != self._released + 1:
            raise ValueError(f"message {seq} released out of order (the last released was {self._released})")
        self._released = seq
        if not self.closed:
            _U64.pack_into(self._mm, RELEASED_AT + 64 * self.index, seq)
            self._post(self._room)

    def close(self) -> None:
        if self._filled:
            self.closed = True
            self._unmap()
