"""The rank processes as the operating system sees them: the thread they are started from, how
one died (read without reaping it; the blame), and their reapers (SIGTERM, a grace, SIGKILL, then
their pipes closed). Standard library, ``runtime.transport.shm_names`` and
``runtime.link.rank_protocol`` only: a rank imports this module (``run_module_main``) before
anything heavy.

Why ranks are started from the supervisor's link thread (``start_rank`` through ``LinkThread.call``):
a rank must die within moments of its engine's SIGKILL whatever it is doing, so it asks the kernel
for it (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, first thing, ``run_module_main``). The kernel's
"parent" there is the *thread* that forked the rank (the signal comes when that thread exits), and
the engine may be built from a short-lived thread: every rank is started from a thread of the
supervisor's own that lives until ``close()`` has reaped the ranks. Ranks never see the terminal's
Ctrl-C: ``start_rank`` blocks SIGINT in that thread (the mask survives fork and exec);
``run_module_main`` sets it to ignored, then unblocks it.

Reaping: every rank has one owner, its replica's reaper thread, started once when the replica
stops serving (a failure, or ``close()``, which joins them all):

    reaper: stop_ranks (SIGTERM, a grace, SIGKILL; it reaps them)
            -> release: wait (bounded) for each exit code, close each Process's pipes whatever
               showed, a ReapedProcess in its place; sweep the dead ranks' /dev/shm names -> then()
            -> a failure (not a close): told to the replica's listeners (``listen``), on this
               thread (the restart controller rebuilds the replica here)

Invariants:
- ``release`` is the only code that closes a rank's ``Process``, and closes its pipes whether or
  not the exit code showed (another thread's ``waitpid`` may have reaped it without storing it).
- Only the owner reaps: everything else reads exit codes with ``WNOWAIT`` (``exit_code``).
- ``Reaping.lock`` guards the ``Process`` objects from the moment a reaper may close them: a thread
  that looks at a rank (``dead_rank``) takes it and skips closed ranks.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
from multiprocessing import resource_tracker
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from runtime.link.rank_protocol import ORPHAN_EXIT
from runtime.transport.shm_names import sweep_creators

log = logging.getLogger("phyrt.supervisor")

#: a rank that does not exit this long after SIGTERM gets SIGKILL
TERM_GRACE_S = 2.0
#: how long a rank is waited for after SIGKILL
KILL_WAIT_S = 5.0
#: how long releasing a stopped rank waits for its exit code to show (see the module docstring)
EXIT_CODE_WAIT_S = 1.0
#: linux/prctl.h
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: the kernel keeps 15 bytes of a thread's name (and a NUL)
_NAME_BYTES = 15


@dataclass
class RankState:
    replica: int
    rank: int
    device: int
    process: Any
    last_beat: float = 0.0  # enforced once the rank is ready; startup_timeout_s covers the start
    ready: bool = False
    decoder: Any = None  # the wire decoder for this rank's answers (results map to its arena)
    # under ``Reaping.lock``: whether its reaper released it (``process`` is a ReapedProcess then)
    closed: bool = False


@dataclass(frozen=True)
class ReapedProcess:
    """What is left of a rank's ``Process`` once it was reaped and closed: who it was and how it
    ended (None: reaped by a wait outside multiprocessing, or running after SIGKILL), same API."""

    pid: int
    name: str
    exitcode: int | None

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


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
    hence ``start_rank`` on the supervisor's link thread. A parent that died before the ``prctl``
    took effect is caught by comparing ``getppid()`` with the parent's pid. Where ``prctl`` is
    unavailable, the rank's heartbeat thread is the fallback: it exits the rank (``ORPHAN_EXIT``) at
    the first beat after its parent pid changed (``workers.main``), a heartbeat interval after the
    engine's death at most.
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
    if not armed:
        log.warning("no prctl(PR_SET_PDEATHSIG) here: this rank notices its engine's death by its heartbeat")


def start_rank(start: Callable[[], Any]) -> Any:
    """``start()`` (a rank's ``Process.start``) with SIGINT blocked in the calling thread, which the
    rank inherits (see the module docstring): call it on the thread that outlives the ranks, the
    supervisor's link thread (``LinkThread.call``). multiprocessing's resource tracker, started by a
    process's first spawn, unblocks SIGINT in the thread that starts it, before its fork: it is
    started first, then SIGINT blocked."""
    if hasattr(signal, "pthread_sigmask"):
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    return start()


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


class Reaping:
    """The reaper threads of the replicas that ended, the release of their ranks, and the blame."""

    def __init__(self, run_id: str) -> None:
        self.lock = threading.Lock()  # the reapers, the listeners, the ranks' release
        self.threads: list[threading.Thread] = []
        self._run_id = run_id
        self._listeners: dict[int, list[Callable[[], None]]] = {}  # replica -> told once it failed
        self._told: set[int] = set()  # replicas whose listeners were told
        self._bound_s = 0.0  # the longest a reaper started so far may take

    def listen(self, index: int, callback: Callable[[], None]) -> bool:
        """``callback()`` on the reaper thread of replica ``index`` once it failed (not at close), after
        its ranks were stopped and released; False (and never called) when its listeners were told
        already."""
        with self.lock:
            if index in self._told:
                return False
            self._listeners.setdefault(index, []).append(callback)
        return True

    def _tell_failed(self, index: int) -> None:
        with self.lock:
            self._told.add(index)
            callbacks = self._listeners.pop(index, [])
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one listener's trouble must not stop the reaper
                log.exception("a listener of replica group %d's failure raised", index)

    def stop(self, index: int, ranks: list[RankState], polite: bool, then: Callable[[], None]) -> None:
        """Start replica ``index``'s reaper (once, at the end of its serving); ``polite``: it was
        closed (its ranks asked to shut down), not failed; ``then()`` once its ranks are released."""
        reaper = threading.Thread(target=self._reap, args=(index, ranks, polite, then),
                                  name=f"phyrt-reaper-{index}", daemon=True)
        with self.lock:  # started before join_all can see it (it takes the lock only in its release)
            self._bound_s = max(self._bound_s, stop_bound_s(len(ranks), polite) + EXIT_CODE_WAIT_S)
            self.threads.append(reaper)
            reaper.start()

    def join_all(self) -> None:
        """Wait for every other reaper (close(), which a listener may call on its reaper); each
        stops its ranks within a bound, so this is bounded too."""
        with self.lock:
            reapers, bound = [t for t in self.threads if t is not threading.current_thread()], self._bound_s + 5.0
        deadline = time.monotonic() + bound
        for reaper in reapers:
            reaper.join(max(0.0, deadline - time.monotonic()))
            if reaper.is_alive():
                log.error("%s has not finished stopping its ranks within %.0f s", reaper.name, bound)

    def _reap(self, index: int, ranks: list[RankState], polite: bool, then: Callable[[], None]) -> None:
        try:
            stop_ranks([r.process for r in ranks], polite=polite)
        finally:  # whatever happens above, the ranks are released, then a failure is told
            try:
                self.release(ranks)
                then()
            finally:
                if not polite:
                    self._tell_failed(index)

    def release(self, ranks: list[RankState]) -> None:
        """Close the ``Process`` of each stopped rank, waiting up to ``EXIT_CODE_WAIT_S`` for its
        exit code; sweep the /dev/shm names the dead left."""
        waiting = list(ranks)
        deadline = time.monotonic() + EXIT_CODE_WAIT_S
        while True:
            with self.lock:
                for r in waiting:
                    code = exit_code(r.process)
                    if code is not None:
                        _close(r, code)
                waiting = [r for r in waiting if not r.closed]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # (the thread that reaped one stores its code meanwhile)
        running = []
        with self.lock:
            for r in waiting:
                if _still_a_child(r.process.pid):
                    running.append(r.process.pid)
                    log.error("replica %d rank %d (pid %d) still runs after SIGKILL; its pipes are closed",
                              r.replica, r.rank, r.process.pid)
                _close(r, None)
        dead = [r.process.pid for r in ranks if r.process.pid not in running]
        if dead:
            sweep_creators(self._run_id, dead)

    def dead_rank(self, ranks: list[RankState], wait_s: float = 0.0) -> str | None:
        """The blame: "rank K <how it exited>" for one of ``ranks`` that has exited (one killed by a
        signal first, then the lowest), waiting up to ``wait_s`` for one to; else None."""
        live: dict[int, RankState] = {}
        try:
            with self.lock:  # a released rank's process is a ReapedProcess, described all the same
                exits = [(r.rank, r.process.exitcode) for r in ranks if r.closed]
                # waited on without the lock: duplicates, as a reaper may close a Process meanwhile
                for r in ranks:
                    if not r.closed:
                        live[os.dup(r.process.sentinel)] = r
            ready = multiprocessing.connection.wait(list(live), 0.0 if exits else wait_s) if live else []
        finally:
            for fd in live:
                os.close(fd)
        if ready:
            with self.lock:
                exits += [(live[fd].rank, live[fd].process.exitcode if live[fd].closed
                           else exit_code(live[fd].process, wait_s=0.1)) for fd in ready]
        if not exits:
            return None
        rank, how = min(((k, describe_exit(code)) for k, code in exits), key=lambda e: ("signal" not in e[1], e[0]))
        return f"rank {rank} {how}"


def _close(r: RankState, code: int | None) -> None:
    """Under ``Reaping.lock``: close ``r.process``'s pipes and put a ``ReapedProcess`` in its place.
    With ``code`` None the exit code never showed: multiprocessing refuses to close such a process,
    so its pipes are closed directly; it stays in multiprocessing's children (whose next poll reaps
    it) unless another wait reaped it already (lest that pid, given to another child, be waited on)."""
    process = r.process
    r.process = ReapedProcess(process.pid, process.name, code)
    r.closed = True
    if code is not None and process.exitcode is not None:  # reaped (by stop_ranks, normally)
        process.close()
        return
    popen = process._popen
    if popen is not None:
        popen.close()  # runs its finalizer: closes the sentinel and the other pipe
    if not _still_a_child(process.pid):
        multiprocessing.process._children.discard(process)


def _still_a_child(pid: int) -> bool:
    """Whether ``pid`` is still a child of this process (running, or a zombie: WNOWAIT reaps nothing)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True
