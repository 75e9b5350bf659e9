"""Copy a large tensor into shared memory with a helper thread taking part.

Imports only ``runtime.transport.spin`` from the project; standard library and numpy otherwise (the
torch-free client imports it).

A same-host request with an image in it costs two copies of the image: the client's
into its arena, the server's result into its own. On the machines we measured
(virtual, 2 cores) one thread copies about 10 GB/s warm and half that with the caches
cold, so the two copies of a 5 MiB frame were most of its round trip. Client and
server copy one after the other, never together, so each copy can borrow the other
core: the array is cut into chunks that the caller and one helper thread take in turn
from a shared counter (``numpy.copyto`` lets go of the GIL while it copies). A helper
that wakes late only takes fewer chunks: the caller never waits for more than the one
chunk the helper is copying, so the split copy is never much slower than a plain one.

``PHYRT_COPY_THREADS`` sets how many threads share a copy (the caller included; 1
turns helpers off). The default is 2 where two cores are usable, else 1. Copies under
``SPLIT_MIN_BYTES`` are plain. The process's copier (``copy``) and its helper live as
long as the process (the helper is a daemon thread that sleeps between copies); a
process forked while a helper runs starts without one and makes its own when it first
needs it.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading

import numpy as np

from runtime.core import env
from runtime.transport import spin

#: copies smaller than this are done by the caller alone (a helper's wake-up would cost more)
SPLIT_MIN_BYTES = 1 << 20
#: the unit the caller and the helpers take in turn
CHUNK_BYTES = 256 << 10
DEFAULT_THREADS = 2
ENV = env.COPY_THREADS


def threads_from_env() -> int:
    """How many threads share a large copy: ``$PHYRT_COPY_THREADS``, else 2 (1 on one core)."""
    wanted = env.copy_threads()
    return min(DEFAULT_THREADS, spin.usable_cores()) if wanted is None else wanted


class _Job:
    """One split copy: chunks handed out by ``_next``, the last one done sets ``finished``."""

    __slots__ = ("dst", "src", "chunks", "_next", "_done", "finished", "error")

    def __init__(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.dst: np.ndarray | None = dst
        self.src: np.ndarray | None = src
        self.chunks = -(-src.nbytes // CHUNK_BYTES)
        self._next = itertools.count()  # next() on it is atomic: each chunk goes to one thread
        self._done = itertools.count(1)
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        """Copy chunks until none is left."""
        while (i := next(self._next)) < self.chunks:
            try:
                lo = i * CHUNK_BYTES
                np.copyto(self.dst[lo:lo + CHUNK_BYTES], self.src[lo:lo + CHUNK_BYTES])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                self.error = exc
            if next(self._done) == self.chunks:
                self.finished.set()


class BulkCopier:
    """``copy(dst, src)`` of flat uint8 arrays, split over ``threads`` threads when large."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads_from_env() if threads is None else threads
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._helpers: list[threading.Thread] = []
        self._pid = os.getpid()

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[:] = src`` (same size, flat uint8); returns when every byte is copied."""
        if dst.nbytes != src.nbytes:
            raise ValueError(f"cannot copy {src.nbytes} bytes into {dst.nbytes}")
        if self.threads < 2 or src.nbytes < SPLIT_MIN_BYTES:
            np.copyto(dst, src)
            return
        job = _Job(dst, src)
        jobs = self._queue()
        for _ in range(self.threads - 1):
            jobs.put(job)
        job.work()
        job.finished.wait()
        job.dst = job.src = None  # every chunk is handed out: a helper that takes the job late copies nothing
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        """Stop the helpers (idempotent); a later large copy starts them again."""
        with self._lock:
            jobs, helpers = self._jobs, self._helpers
            self._jobs, self._helpers = None, []
        if jobs is not None and self._pid == os.getpid():
            for _ in helpers:
                jobs.put(None)
            for helper in helpers:
                helper.join()

    def _queue(self) -> queue.SimpleQueue:
        jobs = self._jobs
        if jobs is not None and self._pid == os.getpid():
            return jobs
        with self._lock:
            if self._jobs is None or self._pid != os.getpid():  # first use, or a forked child
                self._pid = os.getpid()
                self._jobs = queue.SimpleQueue()
                self._helpers = [threading.Thread(target=_helper, args=(self._jobs,), name="phyrt-copy",
                                                  daemon=True) for _ in range(self.threads - 1)]
                for helper in self._helpers:
                    helper.start()
            return self._jobs


def _helper(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job.work()


_shared: BulkCopier | None = None
_shared_lock = threading.Lock()


def _forget_shared() -> None:
    """In a forked child: the parent's helper is not there, and its lock may have been held."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` with this process's shared copier (made on first use, from the environment)."""
    global _shared
    copier = _shared
    if copier is None:
        with _shared_lock:
            if _shared is None:
                _shared = BulkCopier()
            copier = _shared
    copier.copy(dst, src)
