"""Look for a message a short while before sleeping in ``poll``: a thread that sleeps is woken late.

Torch-free: imports only ``runtime.core.env`` of the project (the client imports it).

On the machines we measured (virtual, 2 cores), a thread that sleeps in ``poll`` gives
its CPU back to the host; when its answer comes, waking it, and running Python code
with the caches gone cold, cost more than the rest of a small request's round trip
(``bench.serving``: the server's submit path took ~100 µs woken against ~60 µs warm).
So a thread about to wait for a message first polls without sleeping for a short
budget, yielding the core between looks (``os.sched_yield``: the other side's and
libzmq's threads run meanwhile, so the spin does not starve the very work it waits
for). A short exchange then completes with no sleep at all; a long wait costs at most
the budget of one core, once.

Budgets per side (``BUDGETS_US``, measured on 2-core VMs): the server's looping I/O
thread 400 µs; a client caller 300 µs; a local rank after each answer 300 µs (~10 %
less time for back-to-back small requests to a 1-rank replica, an A/B of 0 against
300 µs); an engine caller reading its ranks' answers 100 µs (300 measured no better).
A ``Spinner`` spins only while spinning pays (its docstring has the two rules): under load
the answer takes longer than any budget (8 client processes on 2 cores: about 1 ms), and
each spin is CPU the other side needs. (A rule that gave a spin up once a yield took long
was tried and dropped: neither throughput nor a lone caller's latency moved beyond the noise.)

``PHYRT_SPIN_US`` (``runtime.core.env``) sets one budget for every side; the budget
is 0 on a single usable core, where spinning only delays the other side. The rank and
engine-caller budgets apply only where the output ranks (one per replica) leave the engine
process a core, and only an output rank spins: the others answer nothing per request, and
their compute needs the core (the supervisor decides; a tp=2 replica's small-request p50 on
2 cores went from 180-204 µs to 89-126 µs when rank 1 stopped spinning and rank 0 started).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from runtime.core import env

#: each side's default budget, in microseconds (see the module's docstring)
BUDGETS_US = {"server": 400, "client": 300, "worker": 300, "caller": 100}


def budget_ns(side: str) -> int:
    """The spin budget of ``side`` (a key of ``BUDGETS_US``) in ns: ``PHYRT_SPIN_US`` if set,
    else the side's default; 0 on a single usable core."""
    us = env.spin_us(BUDGETS_US[side])
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


class Spinner:
    """Spins before a sleep only while spinning has been paying. Under load (many clients on few
    cores) a message takes longer than any budget to come, and each spin burns CPU (and the
    switches of its yields) that the other side needs; a lone caller with a quick peer finds its
    message within the budget every time. Two rules:

    - it spins only after a wait (spin and sleep) that ended within the budget;
    - a spin that did not find the message within the budget puts spinning off for the next
      1, 2, 4, ... ``MAX_SKIP`` waits (doubling while spins keep failing); one that found it in
      time ends the back-off.

    So a caller whose spins keep failing spins before one wait in ``MAX_SKIP`` at most (8 client
    processes on 2 cores, without the back-off, spun before 4 to 8 % of their waits; with it,
    1 to 2 %), and a lone caller whose peer got quick again spins within ``MAX_SKIP`` waits.
    One per waiting thread (not thread-safe, by design: a wrong guess costs one spin)."""

    __slots__ = ("budget", "_spin", "_skip", "_backoff")

    #: the longest back-off, in waits
    MAX_SKIP = 64

    def __init__(self, budget: int) -> None:
        self.budget = budget  # ns
        self._spin = budget > 0
        self._skip = self._backoff = 0

    def wait(self, poll_now: Callable[[], Any], sleep: Callable[..., Any], *args: Any, budget: int | None = None) -> Any:
        """``spin(poll_now, budget or self.budget)`` if spinning pays, then ``sleep(*args)`` unless
        the spin found something; returns what was found."""
        if not self.budget:
            return sleep(*args)
        start = time.perf_counter_ns()
        found = None
        if self._skip:
            self._skip -= 1
        elif self._spin:
            found = spin(poll_now, self.budget if budget is None else budget)
            if found and time.perf_counter_ns() - start <= self.budget:
                self._backoff = 0
            else:
                self._backoff = min(2 * self._backoff or 1, self.MAX_SKIP)
                self._skip = self._backoff
        if not found:
            found = sleep(*args)
        self._spin = time.perf_counter_ns() - start <= self.budget
        return found


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
