"""Making a shared-memory group (``runtime.parallel.shm_collectives``): collectively, over gloo.

    every rank                      group rank 0                   the other ranks
    all_gather (eligible, identity, pid)  -- over the gloo group --
    all eligible, one identity?     creates the named segment,
                                    sem_init, writes a nonce
                                    broadcasts name + nonce  ---->  map it, check the nonce
    every rank: opens a pidfd of each peer
    all_reduce MIN (ok)             unlinks the name (always)
    all ok: ShmGroup on every rank; else None on every rank (gloo serves the group)

The identity is a hash of the boot id, the pid namespace and the uid: ranks of other
hosts, containers or users never try to share (and a pid means the same process to
every rank, which the pidfds need). The name lives only between creation and the
unlink; see ``shm_collectives`` for what the sweeps do should the creator die there.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import secrets
import stat
import sys
from typing import Any

import torch
import torch.distributed as dist

from runtime.parallel.shm_collectives import (HEADER_BYTES, NONCE_BYTES, SEM_STRIDE, SLOT_BYTES, TIMEOUT_S, MAX_RANKS,
                                              ShmGroup, semaphores, segment_seq)
from runtime.transport.shm_names import NAME_RE, SHM_DIR, check_run_id, unlink_quiet

_NAME_BYTES = 64


def segment_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
    """The size of a group's segment: the header, then two sets of ``world`` slots."""
    return HEADER_BYTES + 2 * world * slot_bytes


def create(handle: Any, ranks: tuple[int, ...], rank: int, run_id: str, *, slot_bytes: int = SLOT_BYTES,
           spin_ns: int = 0, timeout_s: float = TIMEOUT_S) -> ShmGroup | None:
    """The shared-memory group over gloo group ``handle`` (world ranks ``ranks``; this process
    is group rank ``rank``), or None on every rank where the ranks cannot share memory.
    Collective: every rank of the group calls it, with the same arguments but ``rank``."""
    check_run_id(run_id)
    world = len(ranks)
    identity = _identity()
    table = _all_gather_ints([1 if identity else 0, identity or 0, os.getpid()], world, handle)
    if world > MAX_RANKS or any(row[0] != 1 or row[1] != table[0][1] for row in table):
        return None
    pids = [row[2] for row in table]
    size = segment_bytes(world, slot_bytes)
    mm, name, nonce = _offer(run_id, size, world, ranks, rank, handle)
    if name is None:
        return None
    pidfds: dict[int, int] = {}
    group = None
    try:
        try:
            if mm is None:
                mm = _map(name, pids[0], size, nonce)
            for r in range(world):
                if r != rank:
                    pidfds[r] = os.pidfd_open(pids[r])
            ok = 1
        except OSError:
            ok = 0
        agreed = torch.tensor([ok], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=handle)
        if rank == 0:
            unlink_quiet(name)  # every rank mapped it, or gave up: the name has served
        if int(agreed.item()) == 1:
            made = ShmGroup(mm, rank, pids, pidfds, slot_bytes=slot_bytes, spin_ns=spin_ns, timeout_s=timeout_s)
            try:
                made.barrier()  # no rank returns before the name is gone
            except BaseException:
                made.close()  # its mapping and pidfds: nothing is left to free below
                mm, pidfds = None, {}
                raise
            group = made
        return group
    finally:
        if rank == 0:
            unlink_quiet(name)  # a peer failed a collective meanwhile
        if group is None:  # not agreed, or a peer failed a collective: free what this rank holds
            for fd in pidfds.values():
                os.close(fd)
            if mm is not None:
                mm.close()


def _identity() -> int | None:
    """What must be equal on every rank of a group for it to share memory; None if this
    process cannot take part (no semaphores, no pidfds, no /dev/shm)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open") or semaphores() is None:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
        if not os.path.isdir(SHM_DIR):
            return None
    except OSError:
        return None
    digest = hashlib.sha256(f"{boot}|{ns.st_dev}:{ns.st_ino}|{os.getuid()}".encode()).digest()
    return int.from_bytes(digest[:7], "little") + 1  # positive, fits an int64


def _all_gather_ints(values: list[int], world: int, handle: Any) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=handle)
    return [row.tolist() for row in rows]


def _offer(run_id: str, size: int, world: int, ranks: tuple[int, ...], rank: int, handle: Any):
    """Group rank 0 makes the segment and tells the others its name and nonce (over gloo).
    Returns (rank 0's mapping, else None; the name, None where rank 0 failed; the nonce)."""
    message = torch.zeros(_NAME_BYTES + NONCE_BYTES, dtype=torch.uint8)
    mm = name = None
    if rank == 0:
        try:
            mm, name, nonce = _make(run_id, size, world)
            message[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
            message[_NAME_BYTES:] = torch.tensor(list(nonce), dtype=torch.uint8)
        except OSError:
            pass  # an empty name: every rank falls back to gloo
    try:
        dist.broadcast(message, src=ranks[0], group=handle)
    except BaseException:
        if mm is not None:
            mm.close()
            unlink_quiet(name)
        raise
    raw = bytes(message[:_NAME_BYTES].tolist()).rstrip(b"\0")
    name = raw.decode("ascii", "replace") if raw else None  # checked by _map: a bad one is a failure to map
    return mm, name, bytes(message[_NAME_BYTES:].tolist())


def _make(run_id: str, size: int, world: int) -> tuple[mmap.mmap, str, bytes]:
    """A fresh named segment, its ``world`` x ``world`` semaphores initialised, a nonce at the
    header's end."""
    while True:
        name = f"phyrt-{run_id}-{os.getpid()}-{next(segment_seq)}"
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            break
        except FileExistsError:
            continue
    try:
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(anchor)
        failed = any(semaphores().sem_init(base + i * SEM_STRIDE, 1, 0) != 0 for i in range(world * world))
        del anchor
        if failed:
            mm.close()
            raise OSError(ctypes.get_errno(), "sem_init of a shared-memory group failed")
    except BaseException:
        unlink_quiet(name)
        raise
    nonce = secrets.token_bytes(NONCE_BYTES)
    mm[HEADER_BYTES - NONCE_BYTES:HEADER_BYTES] = nonce
    return mm, name, nonce


def _map(name: str, creator: int, size: int, nonce: bytes) -> mmap.mmap:
    """Map group rank 0's segment: a regular file of this uid that rank 0 (pid ``creator``)
    named, of the right size, holding its nonce."""
    match = NAME_RE.fullmatch(name)
    if match is None or int(match.group(2)) != creator:
        raise OSError(errno.EINVAL, f"segment {name!r} is not named by group rank 0 (pid {creator})")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
            raise OSError(errno.EINVAL, f"segment {name!r} is not a {size}-byte file of this user")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mm[HEADER_BYTES - NONCE_BYTES:HEADER_BYTES] != nonce:
        mm.close()
        raise OSError(errno.EINVAL, f"segment {name!r} does not hold group rank 0's nonce")
    return mm
