"""Every ``PHYRT_*`` environment variable phyrt reads, read here only, with one parser each.

Leaf module: standard library only (the torch-free client imports it).

    variable             default                         what it does
    PHYRT_SPIN_US        each side's own budget (below)  how long a thread about to sleep in poll
                                                         first polls without sleeping, in µs; 0 = off
    PHYRT_COPY_THREADS   2 where two cores are usable    threads that share a copy of 1 MiB or more
                                                         into shared memory; 1 = the caller alone
    PHYRT_IO_BATCH       0                               1 (Linux): the ZeroMQ I/O threads of clients
                                                         and servers run as SCHED_BATCH threads, more
                                                         requests/s from many clients, longer tails
                                                         next to busy processes (``runtime.transport.zmq_context``)
    PHYRT_LANE           1                               0: an ipc:// client sends its submits, and a local
                                                         engine's ranks their answers, by libzmq only, not
                                                         by a same-host lane (``runtime.link.lane``)

A side's default spin budget was measured on 2-core VMs (``runtime.transport.spin``):
the server's I/O thread 400 µs, a client caller 300 µs, a local rank 300 µs, an engine
caller reading its ranks' answers 100 µs. One number set in ``PHYRT_SPIN_US`` applies to
every side; spinning is off on a single usable core whatever it says.

A bad value raises ``ValueError`` naming the variable, the value and the rule, when the
component that needs it starts.
"""

from __future__ import annotations

import os

SPIN_US = "PHYRT_SPIN_US"
COPY_THREADS = "PHYRT_COPY_THREADS"
IO_BATCH = "PHYRT_IO_BATCH"
LANE = "PHYRT_LANE"
#: every variable above, for docs/environment.md's table and for tests
KNOBS = (SPIN_US, COPY_THREADS, IO_BATCH, LANE)


def spin_us(default_us: float) -> float:
    """``$PHYRT_SPIN_US`` (µs, >= 0) if set, else ``default_us``."""
    raw = os.environ.get(SPIN_US)
    if raw is None:
        return float(default_us)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{SPIN_US} must be a number of microseconds >= 0, got {raw!r}")
    return value


def copy_threads() -> int | None:
    """``$PHYRT_COPY_THREADS`` (a whole number >= 1) if set, else None (the caller decides)."""
    raw = os.environ.get(COPY_THREADS)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{COPY_THREADS} must be a whole number of threads >= 1, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{COPY_THREADS} must be a whole number of threads >= 1, got {raw!r}")
    return value


def io_batch() -> bool:
    """``$PHYRT_IO_BATCH`` ("0" or "1") if set, else False."""
    return _flag(IO_BATCH, False)


def lane() -> bool:
    """``$PHYRT_LANE`` ("0" or "1") if set, else True."""
    return _flag(LANE, True)


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"
