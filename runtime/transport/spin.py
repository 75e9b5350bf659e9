"""Look for a message a short while before sleeping in ``poll``: a thread that sleeps is woken late.

Leaf module: standard library only (the torch-free client imports it).

On the machines we measured (virtual, 2 cores), a thread that sleeps in ``poll`` gives
its CPU back to the host; when its answer comes, waking it, and running Python code
with the caches gone cold, cost more than the rest of a small request's round trip
(``bench.serving``: the server's submit path took ~100 µs woken against ~60 µs warm).
So the server's I/O thread, after its last message, and a client caller waiting for
its answer, first poll without sleeping for a short budget, yielding the core between
looks (``os.sched_yield``: the client's and libzmq's own threads run meanwhile, so the
spin does not starve the very work it waits for). A short exchange then completes
with no sleep at all; a long wait costs at most the budget of one core, once.

The budget is 0 (off) on a machine with a single usable core, where spinning only
delays the other side. A local replica's rank does the same after each answer, for
the next request (``WORKER_SPIN_US``), when the ranks leave the engine process a core:
back-to-back small requests to a 1-rank replica took ~10 % less time on our 2-core VMs
(an A/B of two engines side by side, 0 against 300 µs). Environment overrides:
``PHYRT_SERVER_SPIN_US``, ``PHYRT_CLIENT_SPIN_US`` and ``PHYRT_WORKER_SPIN_US``
(microseconds; 0 turns it off). The supervisor's reading caller has its own shorter
poll (``supervisor.SPIN_S``, measured without yielding, and only when the ranks leave
a core free; 300 µs measured no better than its 100).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

#: default budgets, in microseconds
SERVER_SPIN_US = 400
CLIENT_SPIN_US = 300
WORKER_SPIN_US = 300


def budget_ns(env: str, default_us: float) -> int:
    """The spin budget in ns: ``$env`` if set (a number of µs), else ``default_us``; 0 on one core."""
    raw = os.environ.get(env)
    try:
        us = float(raw) if raw is not None else float(default_us)
    except ValueError:
        raise ValueError(f"{env} must be a number of microseconds, got {raw!r}") from None
    if us <= 0 or usable_cores() < 2:
        return 0
    return int(us * 1000)


def spin(poll_now: Callable[[], Any], budget: int) -> Any:
    """Call ``poll_now()`` (a poll with timeout 0) until it returns something true or ``budget``
    ns passed; what it returned last. Yields the core between calls."""
    end = time.perf_counter_ns() + budget
    while True:
        found = poll_now()
        if found or time.perf_counter_ns() >= end:
            return found
        os.sched_yield()


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
