"""POSIX process-shared semaphores through ctypes: the one binding of ``sem_*`` in phyrt.

Torch-free; imports nothing of the project. Used by ``runtime.link.broadcast`` (the engine's
ring to its ranks) and ``runtime.parallel.shm_collectives`` (collectives of CPU ranks).

A semaphore lives at an address inside a shared mapping (``sem_t`` is 32 bytes on glibc;
callers give each one ``SEM_STRIDE`` bytes). ``sem_init(addr, 1, value)`` (pshared) once, by
the segment's creator, before any other process maps it; then any process that maps it may
``sem_post``, ``sem_trywait`` or ``sem_timedwait``. Post and a successful wait are a release
and an acquire: they publish every write the poster made before posting (no other memory
ordering is assumed, on any architecture).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time
from typing import Any

__all__ = ["SEM_STRIDE", "Timespec", "semaphores", "timed_wait"]

#: bytes a caller gives each semaphore (a glibc ``sem_t`` is 32; a cache line keeps them apart)
SEM_STRIDE = 64
_libc: Any = None


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def semaphores() -> Any:
    """The C library with its sem_* functions typed, or None where there is none."""
    global _libc
    if _libc is None:
        _libc = False
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
            for name in ("sem_post", "sem_trywait"):
                getattr(lib, name).argtypes = [ctypes.c_void_p]
            lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(Timespec)]
            _libc = lib
        except (OSError, AttributeError):
            pass
    return _libc or None


def timed_wait(timedwait: Any, sem: Any, when: Timespec, seconds: float) -> bool:
    """One ``sem_timedwait`` of at most ``seconds`` (``when``: a Timespec to reuse); True if it
    took the semaphore, False on the timeout or a signal; OSError on anything else."""
    wake = time.time() + seconds
    when.tv_sec, when.tv_nsec = int(wake), int((wake % 1.0) * 1e9)
    if timedwait(sem, ctypes.byref(when)) == 0:
        return True
    err = ctypes.get_errno()
    if err not in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
        raise OSError(err, f"sem_timedwait: {os.strerror(err)}")
    return False
