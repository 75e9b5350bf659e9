"""Collectives through shared memory for the CPU ranks of one group on one host.

gloo carries every collective over TCP on loopback: about 1 ms a call on a loaded
2-core machine, whatever the size, two per layer per decode step. Ranks of one host
meet in one shared segment instead::

    group rank 0 (``shm_setup.create``)          every rank, each step k (set s = k % 2)
    creates /dev/shm/phyrt-<run>-<pid>-<seq>     copies its input into its slot of set s
      sem_init W x W semaphores (pshared)        posts sem[p][me] for every peer p
    broadcasts the name over gloo  ------->      waits on sem[me][p] for every peer p
    every rank maps it, checks the nonce         reads what it needs of the W slots of set s
    all agree (gloo all_reduce MIN)
    rank 0 unlinks the name

Layout: a 4 KiB header (semaphore ``sem[r][s]`` at ``(r * W + s) * 64``, the creator's
nonce at its end), then two sets of W slots of ``slot_bytes`` each. A tensor larger
than a slot goes in slot-sized chunks, one step each.

Invariants:

- Order. Every rank runs the same collectives in the same order, with the same shapes
  and dtypes (as gloo requires too). A rank writes set s at step k + 2 only after every
  peer posted step k + 1, which a peer does only once it has read step k: two sets
  suffice and no rank runs more than one step ahead. ``sem[me][p]`` counts peer p's
  posts to this rank, one per step; post and wait are the release and acquire that
  publish the slot writes (no other memory ordering is assumed, on any architecture).
- Same result everywhere. Every rank reduces the W slots itself, in group-rank order,
  ``((s0 op s1) op s2) ...``, with the same torch kernels: the result is bitwise the
  same on every rank; a sum equals gloo's within float rounding (exactly, for 2 ranks).
- Waiting. A rank polls its semaphore for ``spin_ns`` (``runtime.transport.spin``,
  yielding the core between looks), then sleeps in ``sem_timedwait``: nothing spins
  while a group is idle. Every ``POLL_S`` asleep it looks at its peers' pidfds; a
  peer that exited raises ``PeerExitedError`` at once, never a hang (the supervisor
  then blames the dead rank, as it does for gloo's errors). A stopped peer is waited
  for until the supervisor's heartbeat deadline takes the group down, or ``timeout_s``.
- Names. The segment is named only while the group is made: rank 0 unlinks it once
  every rank mapped it (or failed to). A creator killed meanwhile leaves a name of its
  run that the supervisor's sweeps remove (``runtime.transport.shm_names``). The memory
  lives on until the last rank unmaps it: ``close()``, or the process's exit.

Eligible (else ``shm_setup.create`` returns None on every rank and gloo serves the
group): Linux with the C library's ``sem_*`` and ``os.pidfd_open``, at most
``MAX_RANKS`` ranks, one boot id, pid namespace and uid on every rank, and a segment
every rank could map and read the creator's nonce from; the ranks agree on it over
gloo, so all take one path.

A group is used by one thread at a time, as a gloo group is.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import select
import time

import torch

# SEM_STRIDE and semaphores are shm_setup's too (one binding: runtime.transport.semaphores)
from runtime.transport.semaphores import SEM_STRIDE, Timespec, semaphores, timed_wait
from runtime.transport.spin import spin

#: the most ranks a shared-memory group holds (its semaphores fill the 4 KiB header)
MAX_RANKS = 8
#: bytes of one rank's slot in one set; larger tensors go in chunks of this size
SLOT_BYTES = 1 << 20
#: how often a sleeping rank looks whether its peers are still alive
POLL_S = 0.05
#: the longest wait for a live peer (gloo's default group timeout)
TIMEOUT_S = 1800.0
#: dtypes ``all_reduce`` handles (gathers and broadcasts move bytes: any dtype)
REDUCE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}
#: the header: semaphore sem[r][s] at (r * W + s) * SEM_STRIDE, the creator's nonce in its last bytes
HEADER_BYTES = 4096
NONCE_BYTES = 16
#: segment numbers, far above the transport arenas' own, so that the names of one pid never meet
segment_seq = itertools.count(1 << 32)


class PeerExitedError(RuntimeError):
    """A rank of a shared-memory group exited while this rank waited for it in a collective."""


class ShmGroup:
    """One group's segment as seen by one of its ranks; made by ``create`` (collectively)."""

    def __init__(self, mm: mmap.mmap, rank: int, pids: list[int], pidfds: dict[int, int], *,
                 slot_bytes: int = SLOT_BYTES, spin_ns: int = 0, timeout_s: float = TIMEOUT_S) -> None:
        lib = semaphores()
        self.rank, self.size, self.pids = rank, len(pids), list(pids)
        self._mm, self._pidfds, self._slot_bytes = mm, dict(pidfds), slot_bytes
        self._spin_ns, self._timeout_s = spin_ns, timeout_s
        self._post, self._trywait, self._timedwait = lib.sem_post, lib.sem_trywait, lib.sem_timedwait
        self._anchor = ctypes.c_char.from_buffer(mm)  # pins the mapping while semaphores point into it
        base = ctypes.addressof(self._anchor)
        w = self.size
        self._sems = [[ctypes.c_void_p(base + (r * w + s) * SEM_STRIDE) for s in range(w)] for r in range(w)]
        self._peers = [p for p in range(w) if p != rank]
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self._views: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._poller = select.poll()
        for fd in self._pidfds.values():
            self._poller.register(fd, select.POLLIN)
        self._step = 0
        self.closed = False

    # -- the collectives (x: a contiguous CPU tensor; the same call on every rank) ---------

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``x`` in place (op in sum/max/min/prod, dtype in ``REDUCE_DTYPES``); returns it."""
        fn, flat = _REDUCE[op], x.view(-1)
        chunk = self._slot_bytes // x.element_size()
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            slots = self._next(x.dtype)[:, :part.numel()]
            slots[self.rank].copy_(part)
            self._sync()
            fn(slots[0], slots[1], out=part)
            for r in range(2, self.size):
                fn(part, slots[r], out=part)
        return x

    def all_gather(self, x: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
        """Every rank's ``x`` as rows of a ``[W, x.numel()]`` tensor, in group-rank order;
        None where ``keep`` is false (a gather to another rank)."""
        src = x.reshape(-1).view(torch.uint8)
        out = torch.empty((self.size, x.numel()), dtype=x.dtype) if keep else None
        rows = out.view(torch.uint8) if out is not None else None
        for start in range(0, src.numel(), self._slot_bytes):
            n = min(self._slot_bytes, src.numel() - start)
            slots = self._next(torch.uint8)[:, :n]
            slots[self.rank].copy_(src[start:start + n])
            self._sync()
            if rows is not None:
                rows[:, start:start + n].copy_(slots)
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``x`` in place with group rank ``src``'s; returns it."""
        flat = x.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), self._slot_bytes):
            n = min(self._slot_bytes, flat.numel() - start)
            slot = self._next(torch.uint8)[src, :n]
            if self.rank == src:
                slot.copy_(flat[start:start + n])
            self._sync()
            if self.rank != src:
                flat[start:start + n].copy_(slot)
        return x

    def barrier(self) -> None:
        self._next(torch.uint8)
        self._sync()

    # -- steps ------------------------------------------------------------------------------

    def _next(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[W, slot]`` view of this step's set as ``dtype``; counts the step."""
        if self.closed:
            raise RuntimeError("this shared-memory group is closed (runtime.parallel was destroyed)")
        key = (self._step & 1, dtype)
        self._step += 1
        view = self._views.get(key)
        if view is None:
            size = self.size * self._slot_bytes
            start = HEADER_BYTES + key[0] * size
            view = self._views[key] = self._bytes[start:start + size].view(dtype).view(self.size, -1)
        return view

    def _sync(self) -> None:
        """Tell every peer this rank's slot is written; wait until every peer said so too."""
        row = self._sems
        for p in self._peers:
            self._post(row[p][self.rank])
        for p in self._peers:
            sem = row[self.rank][p]
            if self._trywait(sem) != 0:
                self._wait(sem, p)

    def _wait(self, sem: ctypes.c_void_p, peer: int) -> None:
        trywait = self._trywait
        if self._spin_ns and spin(lambda: trywait(sem) == 0, self._spin_ns):
            return
        deadline = time.monotonic() + self._timeout_s
        when = Timespec()
        while True:
            if timed_wait(self._timedwait, sem, when, POLL_S):
                return
            self._check_peers()
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory collective: group rank {peer} (pid {self.pids[peer]}) did not "
                                   f"arrive within {self._timeout_s:g} s")

    def _check_peers(self) -> None:
        ready = {fd for fd, _ in self._poller.poll(0)}  # a pidfd turns readable when its process exits
        exited = [r for r, fd in sorted(self._pidfds.items()) if fd in ready]
        if exited:
            r = exited[0]
            raise PeerExitedError(f"group rank {r} (pid {self.pids[r]}) exited while group rank {self.rank} "
                                  "waited for it in a shared-memory collective")

    def close(self) -> None:
        """Unmap the segment and close the pidfds; idempotent. Later collectives raise."""
        if self.closed:
            return
        self.closed = True
        self._views.clear()
        self._sems = []
        self._bytes = self._anchor = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds = {}

