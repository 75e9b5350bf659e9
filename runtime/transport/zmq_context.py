"""``io_context()``: the ZeroMQ context of a client or a server; with ``PHYRT_IO_BATCH=1`` its
I/O thread is a batch thread.

Torch-free: imports only ``runtime.core.env`` of the project (the client imports it).

Every message a Python thread sends or receives wakes the context's I/O thread (libzmq's
``ZMQbg/IO``), which moves it between the socket and the peer. On a machine whose cores
are all busy with our own processes (8 client processes and a server on 2 cores), the
scheduler lets that freshly woken thread preempt the very Python thread that woke it, in
the middle of its work: the server's looping thread was preempted 0.6 times per request, a
client's caller 0.4 times (a bare ZMQ echo's threads, which run a few µs per message, 0.2),
each time one more switch and a cold cache for the Python code when it resumes.

A ``SCHED_BATCH`` thread (Linux, no privilege needed) is scheduled like any other, except
that its wake-up preempts nobody: it runs at once on an idle core, and otherwise when the
running thread sleeps or its time slice ends. Measured on 2-core VMs (interleaved A/B, both
sides batch against neither): 8 client processes served 1.17x the requests/s, 24 processes
1.22x, with less CPU per request on both sides (involuntary switches per request: server
0.6 -> 0.2, client 0.4 -> 0.03); a lone caller's round trip p50 98 against 114-124 µs.

The price, and why it is not the default: next to *other* busy processes (two
``while True: pass`` processes on the two cores), the I/O thread now waits for their time
slice instead of preempting them, and a lone caller's round trip went from p90 0.38 ms to
3.9 ms, p99 4.1 ms to 8.0 ms. So ``PHYRT_IO_BATCH=1`` (``runtime.core.env``) suits a server
machine that serves many clients and runs little else; a robot's computer, busy with
perception and planning, keeps the default ordinary threads. Elsewhere than on Linux, or
where the kernel refuses the policy (probed once per process on the calling thread, which
then returns to its ordinary policy: libzmq aborts the process if setting it fails), the context is an ordinary one.
"""

from __future__ import annotations

import os

import zmq

from runtime.core import env

_usable: bool | None = None


def io_context() -> zmq.Context:
    """A new ``zmq.Context`` with one I/O thread: a batch thread with ``PHYRT_IO_BATCH=1`` where
    that is possible, else an ordinary one."""
    ctx = zmq.Context(1)
    if env.io_batch() and batch_usable():
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return ctx


def batch_usable() -> bool:
    """Whether threads of this process may switch to ``SCHED_BATCH``: tried once, on the calling
    thread, which then goes back to ``SCHED_OTHER`` (always allowed). A thread on another policy (a
    real-time one, say, whose return might need a privilege) does not try: no batch then."""
    global _usable
    if _usable is None:
        _usable = False
        if hasattr(os, "SCHED_BATCH") and hasattr(zmq, "THREAD_SCHED_POLICY") \
                and os.sched_getscheduler(0) == os.SCHED_OTHER:
            try:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            except OSError:
                pass
            else:
                _usable = True
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return _usable
