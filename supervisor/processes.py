"""The rank processes as the operating system sees them: the thread they are started
from, how one died (read without reaping it), how to stop a group (SIGTERM, a grace,
SIGKILL) and whether a rendezvous port is free. (Run directories whose engine process no
longer exists are removed by ``runtime.transport.owners.sweep_run_dirs``.)

Why ranks are started from a ``SpawnThread``: a rank must die within moments of its
engine's SIGKILL whatever it is doing, a long C call that holds the GIL included, so
the rank asks the kernel for it (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, first thing
in the rank, ``run_module_main``): no thread of the rank has to run. But the kernel's
"parent" there is the *thread* that forked the rank (multiprocessing's spawn forks
in the thread that calls ``Process.start()``), and the signal comes when that thread
exits, even though the engine process lives on. The engine may be built from any
thread (a short-lived one included), so the supervisor starts every rank from a
thread of its own that does nothing else and lives until the supervisor's
``close()`` has reaped the ranks; when the engine process dies, that thread dies
with it and the kernel SIGKILLs the ranks. A reaper process was the alternative: it
needs no GIL either, but it is one more process to start, to keep from leaking, and
to tell apart from the ranks; this costs one idle thread.

Why ranks never see the terminal's Ctrl-C: the terminal signals its whole foreground
process group, ranks included, but the engine process decides when its ranks stop
(a rank gone mid-request takes its replica down). The ``SpawnThread`` blocks SIGINT
for itself, so every rank starts with SIGINT blocked (the mask survives fork and
exec: a Ctrl-C while the rank imports Python stays pending); ``run_module_main``
then sets SIGINT to ignored, which drops a pending one, and unblocks it.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
from multiprocessing import resource_tracker
import multiprocessing.connection
import os
import queue
import signal
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

#: a rank that does not exit this long after SIGTERM gets SIGKILL
TERM_GRACE_S = 2.0
#: how long a rank is waited for after SIGKILL
KILL_WAIT_S = 5.0
#: linux/prctl.h
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: the kernel keeps 15 bytes of a thread's name (and a NUL)
_NAME_BYTES = 15
#: the exit code of a rank whose engine is gone
ORPHAN_EXIT = 70


def run_module_main(module: str, boot: bytes) -> None:
    """A rank process's target: ``module.main(boot)``. The supervisor names the rank's entry
    point by module path and never imports it (the rank's code sits above the supervisor).
    The rank's death with its engine is armed first, before the import (torch, seconds on a
    loaded machine): an engine SIGKILLed meanwhile takes the rank with it at once. Then the
    terminal's Ctrl-C is shut out (see the module docstring) and the process takes its
    ``Process`` name, ``phyrt-r{replica}-{rank}``, as its kernel name (``ps -o comm``, top)."""
    die_with_parent()
    ignore_sigint()
    set_process_name(multiprocessing.current_process().name)
    importlib.import_module(module).main(boot)


def ignore_sigint() -> None:
    """Ignore SIGINT from now on (a pending one is dropped), then unblock it, so that
    processes this rank starts do not inherit a blocked signal."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def set_process_name(name: str) -> None:
    """Set the calling thread's kernel name (the process's name when called from its main
    thread), cut to the kernel's 15 bytes; nothing happens where ``prctl`` is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(ctypes.c_int(_PR_SET_NAME), ctypes.c_char_p(name.encode()[:_NAME_BYTES]), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):  # no prctl: not Linux
        pass


def die_with_parent() -> None:
    """Exit when the engine process dies, however it died and whatever this rank does.

    ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process the moment its parent
    goes, even while its main thread holds the GIL in a long C call (a Python thread watching
    the parent could not run then). The kernel's "parent" is the thread that forked the rank,
    hence ``SpawnThread``. A parent that died before the ``prctl`` took effect is caught by
    comparing ``getppid()`` with the parent's pid. Where ``prctl`` is unavailable, a thread
    waiting on multiprocessing's parent sentinel (EOF once the parent is gone) is the fallback.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                           ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        armed = False
    if os.getppid() != parent.pid:  # the parent died before the prctl took effect
        os._exit(ORPHAN_EXIT)
    if armed:
        return
    sentinel = parent.sentinel  # EOF once the parent is gone: only it holds the write end

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(ORPHAN_EXIT)

    threading.Thread(target=watch, name="phyrt-death-watch", daemon=True).start()


class SpawnThread:
    """The thread that starts the ranks and outlives them (see the module docstring).

    ``call(fn)`` runs ``fn`` on this thread and returns its result or raises its
    exception; ``stop()`` ends the thread, and must come only after the ranks it
    started are gone (any still alive then get SIGKILL from the kernel).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, future = item
            # inherited by every rank started here (module docstring). multiprocessing's
            # resource tracker, started by a process's first spawn, unblocks SIGINT in the
            # thread that starts it, before the fork: start it first, then block (each call)
            if hasattr(signal, "pthread_sigmask"):
                resource_tracker.ensure_running()
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            del item, fn, future  # hold no process between calls

    def call(self, fn: Callable[[], Any]) -> Any:
        if not self._thread.is_alive():
            raise RuntimeError("the spawn thread is stopped")
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result()

    def stop(self) -> None:
        self._calls.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(5)


def exit_code(process: Any, wait_s: float = 0.0) -> int | None:
    """How ``process`` ended (multiprocessing's convention: negative, killed by that signal), or
    None while it runs, waiting up to ``wait_s`` for it to show. Looked at without reaping
    (``WNOWAIT``): the rank's reaper stays the only thread of the supervisor that reaps it.
    One reaped by another wait (multiprocessing's own, in any ``Process.start``) reads the
    code that wait stored, once it has."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already: no wait here can reap it again
            code = process.exitcode
        else:
            code = None if info is None else (info.si_status if info.si_code == os.CLD_EXITED
                                               else -info.si_status)
        if code is not None or time.monotonic() >= deadline:
            return code
        # the sentinel fires as the rank closes its files, a moment before it is a zombie
        time.sleep(0.005)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_bound_s(ranks: int, polite: bool) -> float:
    """How long ``stop_ranks`` may take for ``ranks`` processes at most."""
    return (TERM_GRACE_S if polite else 0.0) + TERM_GRACE_S + KILL_WAIT_S * ranks


def stop_ranks(processes: list[Any], polite: bool = False) -> None:
    """SIGTERM (after a polite shutdown message, a moment to exit), then SIGKILL."""
    deadline = time.monotonic() + (TERM_GRACE_S if polite else 0.0)
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + TERM_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(KILL_WAIT_S)


def check_port_free(port: int, replica: int) -> None:
    """Raise ValueError when rank 0 of ``replica`` could not listen on ``port`` (a pinned
    ``base_port``; a free rendezvous needs no port).

    SO_REUSEADDR, as the rank's own listener sets it: connections of a previous engine
    in TIME_WAIT on the port (for a minute after it closed) are no obstacle; a listener is.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ValueError(
                f"rendezvous port {port} of replica {replica} (base_port + {replica}) is taken: {exc}; "
                "pass base_port=None (the default) for a free rendezvous, or set "
                "WorkerSupervisorConfig(base_port=...) to a free range"
            ) from None
