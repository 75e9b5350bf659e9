"""Shared-memory arenas: how large CPU tensors cross a process boundary on one host.

Imports only ``runtime.core.errors`` from the project (and numpy); no torch.

    owner process: ShmArena                     peer process: ShmMapper
    creates /dev/shm/phyrt-<run>-<pid>-<seq>
    place(n) -> (segment, offset, view)
    copies the tensor in, sends the ref  ---->  view(segment, offset, n): maps the
                                                segment on first use, checks bounds
    unlink(name) once every peer mapped it      (its mapping stays valid)
    free(segment, offset) once the peer is done with the block
    close(): unlinks and unmaps everything

Ownership. One process creates and owns each arena; only it places, frees and
unlinks. A peer only maps, and only names of its own run:
``phyrt-{run_id}-{creator_pid}-{seq}``, matched by a strict regex (no slashes, no
``..``), opened with O_NOFOLLOW, owned by this uid.

Names. A name is needed only until every peer has mapped the segment; the owner
should ``unlink`` it then (the memory lives on in the mappings), so that a crash
afterwards cannot leak it. A segment added by growth has a new name that peers
must map before it is unlinked. ``close()`` unlinks whatever is still linked, and
a finalizer does the same if an arena is dropped without ``close()``.

kill -9 (``runtime.transport.shm_names``). A killed process runs no cleanup: its still-linked names stay in
/dev/shm (the memory is freed once the last mapping goes). ``sweep_stale()``
removes names whose creator pid is dead (or reused by a younger process);
``sweep_run(run_id)`` removes every name of one run, ``sweep_creators(run_id,
pids)`` those of some of its processes (dead, reaped ranks). Call one of them at
start and after a group dies, and nothing leaks even if the whole tree was killed.

Blocks are 64-byte aligned and placed first-fit; freed blocks coalesce with
their neighbours. A decoded tensor is a view: reusing a freed block overwrites
what a peer still viewing it sees, so free only after the peer is done.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import mmap
import os
import stat
import threading
import weakref

import numpy as np

from runtime.core.errors import ProtocolError
from runtime.transport.lending import LentBlocks
from runtime.transport.shm_names import (NAME_RE, SHM_DIR, check_run_id, new_run_id, sweep_creators, sweep_run,
                                         sweep_stale, unlink_quiet)

__all__ = ["ALIGNMENT", "SHM_DIR", "ShmArena", "ShmMapper", "new_run_id", "sweep_creators", "sweep_run",
           "sweep_stale"]

ALIGNMENT = 64
_PAGE = mmap.PAGESIZE
_seq = itertools.count()  # process-wide, so two arenas of one run never collide


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _unlink_names(owner_pid: int, names: set[str]) -> None:
    # a forked child inherits the finalizer but not the ownership
    if os.getpid() == owner_pid:
        for name in list(names):
            unlink_quiet(name)
        names.clear()


def _release(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        # views are still alive: the mapping goes when the last of them dies;
        # unmapping now would turn them into dangling pointers
        pass


def _prefault(mm: mmap.mmap) -> None:
    advice = getattr(mmap, "MADV_POPULATE_WRITE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
            return
        except OSError:  # kernels before 5.14 reject the advice
            pass
    np.frombuffer(mm, dtype=np.uint8)[::_PAGE] = 0  # one write fault per page


class _Segment:
    __slots__ = ("name", "size", "mm", "free", "used", "linked")

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name, self.size, self.mm = name, size, mm
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted, coalesced
        self.used: dict[int, int] = {}  # offset -> size
        self.linked = True

    def take(self, size: int) -> int | None:
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, length - size)
                self.used[offset] = size
                return offset
        return None

    def give_back(self, offset: int) -> None:
        size = self.used.pop(offset)
        i = bisect.bisect_left(self.free, (offset,))
        if i < len(self.free) and offset + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == offset:
            offset, size = self.free[i - 1][0], self.free[i - 1][1] + size
            i -= 1
            del self.free[i]
        self.free.insert(i, (offset, size))


class ShmArena:
    """A pool of shared-memory segments owned by this process (wire's allocator)."""

    def __init__(self, run_id: str, capacity_bytes: int, *, prefault: bool = True) -> None:
        self.run_id = check_run_id(run_id)
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self._prefault = prefault
        self._pid = os.getpid()
        self._lock = threading.Lock()  # place and free may come from different threads
        self._segments: dict[str, _Segment] = {}
        self._linked: set[str] = set()
        self._finalizer = weakref.finalize(self, _unlink_names, self._pid, self._linked)
        self._closed = False
        self._lent = LentBlocks()  # blocks a caller writes and sends as they are (runtime.transport.lending)
        self._let_go: collections.deque[tuple[str, int]] = collections.deque()  # see let_go
        self._grow(capacity_bytes)

    @property
    def segments(self) -> list[str]:
        """Names of the segments, oldest first (unlinked ones included)."""
        return list(self._segments)

    @property
    def capacity(self) -> int:
        return sum(seg.size for seg in self._segments.values())

    def _grow(self, size: int) -> _Segment:
        size = _round_up(size, _PAGE)
        for _ in range(64):
            name = f"phyrt-{self.run_id}-{self._pid}-{next(_seq)}"
            path = os.path.join(SHM_DIR, name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:  # left by an earlier process with this pid and run
                continue
        else:
            raise FileExistsError(f"could not create a fresh segment name for run {self.run_id}")
        self._linked.add(name)
        try:
            if self._prefault:
                # reserves the tmpfs pages now: a full /dev/shm fails here with
                # ENOSPC instead of a SIGBUS on first touch
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if self._prefault:
                _prefault(mm)
        except BaseException:
            unlink_quiet(name)
            self._linked.discard(name)
            raise
        finally:
            os.close(fd)
        seg = self._segments[name] = _Segment(name, size, mm)
        return seg

    def place(self, nbytes: int) -> tuple[str, int, memoryview]:
        """Reserve ``nbytes`` (64-byte aligned); grow by a new segment when full."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        size = max(ALIGNMENT, _round_up(nbytes, ALIGNMENT))  # 0 bytes still gets a distinct block
        with self._lock:
            if self._closed:
                raise ValueError("the arena is closed")
            if self._let_go:
                self._settle()
            for seg in self._segments.values():
                offset = seg.take(size)
                if offset is not None:
                    break
            else:
                last = list(self._segments.values())[-1]
                seg = self._grow(max(2 * last.size, size))
                offset = seg.take(size)
            return seg.name, offset, memoryview(seg.mm)[offset:offset + nbytes]

    def lend(self, nbytes: int) -> tuple[str, int, memoryview, int]:
        """``place``, for a caller who fills the block and sends it as it is: (segment, offset,
        view, address of the view). The caller holds the block until it lets go once (``free``,
        or ``let_go`` from a finalizer); each message that ``borrow``s it holds it until its own
        ``free``."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"a lent block holds at least 1 byte, got {nbytes!r}")
        segment, offset, view = self.place(nbytes)
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        with self._lock:
            self._lent.add(segment, offset, address, nbytes)
        return segment, offset, view, address

    def borrow(self, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """The lent block that holds ``nbytes`` bytes from ``address``, with one more holder:
        (segment, block offset to ``free`` later, offset of ``address``); None if no lent block
        of this arena holds them (the tensor is copied as any other)."""
        with self._lock:
            return None if self._closed else self._lent.find(address, nbytes)

    def free(self, segment: str, offset: int) -> None:
        """Give a block back (a lent one once its last holder let go). A no-op after close(), so
        teardown order does not matter."""
        with self._lock:
            if self._closed:
                return
            if self._let_go:
                self._settle()
            self._give_back(segment, offset)

    def let_go(self, segment: str, offset: int) -> None:
        """``free`` later, from any thread, without the lock: for a finalizer, which may run while
        this very thread holds it. Done at the next ``place`` or ``free``."""
        self._let_go.append((segment, offset))

    def _settle(self) -> None:
        while self._let_go:
            self._give_back(*self._let_go.popleft())

    def _give_back(self, segment: str, offset: int) -> None:
        if self._lent.drop(segment, offset) is False:
            return  # a lent block that is still held
        seg = self._segments.get(segment)
        if seg is None or offset not in seg.used:
            raise ValueError(f"no block is placed at {segment!r}+{offset!r}")
        seg.give_back(offset)

    def unlink(self, name: str) -> None:
        """Remove the segment's name; every existing mapping stays valid."""
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                raise ValueError(f"{name!r} is not a segment of this arena")
            if seg.linked:
                unlink_quiet(name)
                seg.linked = False
                self._linked.discard(name)

    def unlink_all(self) -> None:
        for name in self.segments:
            self.unlink(name)

    def close(self) -> None:
        """Unlink every name and unmap every segment (live views keep theirs). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            segments, self._segments = list(self._segments.values()), {}
            self._lent.clear()
        _unlink_names(self._pid, self._linked)
        for seg in segments:
            _release(seg.mm)
        self._finalizer.detach()

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmMapper:
    """The receiving side: maps segments of one run by name, on first use."""

    def __init__(self, run_id: str) -> None:
        self.run_id = check_run_id(run_id)
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}
        self._closed = False

    @property
    def segments(self) -> list[str]:
        return list(self._maps)

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` at ``offset``; ProtocolError if out of bounds or not ours."""
        match = NAME_RE.fullmatch(segment) if isinstance(segment, str) else None
        if match is None:
            raise ProtocolError(f"{segment!r} is not a phyrt segment name")
        if match.group(1) != self.run_id:
            raise ProtocolError(f"segment {segment!r} belongs to another run than {self.run_id!r}")
        for value in (offset, nbytes):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProtocolError(f"offset and nbytes must be ints >= 0, got {offset!r}, {nbytes!r}")
        with self._lock:
            if self._closed:
                raise ProtocolError("the shared-memory mapper is closed")
            mm = self._maps.get(segment)
            if mm is None:
                mm = self._maps[segment] = self._map(segment)
        if offset + nbytes > len(mm):
            raise ProtocolError(f"{segment}+{offset} ({nbytes} bytes) reaches past its end at {len(mm)}")
        return memoryview(mm)[offset:offset + nbytes]

    @staticmethod
    def _map(name: str) -> mmap.mmap:
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise ProtocolError(f"segment {name!r} does not exist (unlinked before it was mapped?)") from exc
        except OSError as exc:
            raise ProtocolError(f"cannot open segment {name!r}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size == 0:
                raise ProtocolError(f"segment {name!r} is not a non-empty regular file of this user")
            return mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def release(self, segment: str) -> None:
        """Drop one mapping (e.g. after its owner closed the arena)."""
        with self._lock:
            mm = self._maps.pop(segment, None)
        if mm is not None:
            _release(mm)

    def close(self) -> None:
        """Drop every mapping (live views keep theirs). Idempotent."""
        with self._lock:
            self._closed = True
            maps, self._maps = list(self._maps.values()), {}
        for mm in maps:
            _release(mm)

    def __enter__(self) -> ShmMapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
