"""The kill matrix: a rank of a local replica dies at every stage of a request, in
every way a process dies, as the output rank or not.

    stage        how the rank gets there (``tests.plugins.KillProbe``, op "die")
    decode       an earlier request arms the rank: it dies inside ``wire.unpack_message``
                 of the NEXT request, once that frame is decoded (its shared-memory
                 tensor mapped) and before the plugin sees it
    plugin       it dies inside ``execute``; the other rank waits in a world barrier
    collective   both ranks loop 1 MiB world all_reduces; a thread of the victim kills
                 it 0.3 s into the loop, inside a collective (the shared-memory one of
                 ``runtime.parallel.shm_collectives``: the ranks share a host)
    encode       output rank: its result is a ``LethalArray``, whose ``nbytes`` the wire
                 codec reads while it encodes the reply; non-output rank: it dies inside
                 ``wire.pack_message("done", ...)`` of its result-less reply
    idle         nothing in flight: this process signals the rank (``os._exit(1)``: a
                 thread of the rank calls it while its serve loop waits), then submits

    ways: SIGKILL, SIGTERM, a segfault (NULL dereference; SIGSEGV from outside when
    idle), os._exit(1), SIGSTOP (seen only by the missing heartbeats)

Every case, on a replica of its own (``ReplicaPool``: engines of four tp-2 replicas;
three of them are casualties, the fourth the witness that the others keep serving; the
next engine starts in the background while the cases run): every future of that replica
ends with ``EngineUnavailableError`` naming the replica within ``BOUND_S`` (SIGSTOP:
``STOP_BOUND_S``), a request running on the witness meanwhile succeeds and later requests
are served, the victim's ranks are gone, its socket connections are closed (file
descriptors counted per run directory, from /proc/net/unix, since another engine may be
starting), and no /dev/shm name or run-dir file was added. A used-up engine is closed and
must leave no socket fd, spawn pipe, process, segment or directory; the module ends with
this process's fd count back where it started and no child process at all.

Requests are sent to a chosen replica through its executor (``submit_to``), the
dispatcher's own path minus the choice of replica.

The last tests guard against bugs they once showed (as strict xfails): shared-memory
names that outlive a failed group, a rank death blamed on the surviving rank when the
engine is busy, spawn pipes that ``Engine.close()`` left to the garbage collector, and a
submit racing a rank's death that deadlocked the whole engine.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import psutil
import pytest
import torch

from runtime import EngineUnavailableError, RemoteError
from tests import conftest
from tests.conftest import (REAP_GRACE_S, WatchedLock, close_engine, group_pids, pid_alive,
                            run_sockets, shm_names, start_engine, supervisor_of, tp_parallel, wait_until)
from tests.plugins import DEATHS, STAGES, _hold_gil, mark_files

pytestmark = [pytest.mark.timeout(240)]

ROLES = {"output": 0, "non-output": 1}
#: cases that cannot happen: a non-output rank encodes no reply (it answers nothing per request)
NOT_APPLICABLE = {("encode", "non-output"): "a non-output rank encodes no reply: only the output rank answers"}
REPLICAS_PER_ENGINE = 4
HEARTBEAT_INTERVAL_S = 0.25
#: generous for a loaded 2-core machine: a false alarm would take a spare replica down
HEARTBEAT_TIMEOUT_S = 4.0
#: every future of a replica whose rank exited fails within this (from the request that kills it)
BOUND_S = 5.0
#: a stopped rank is seen by its missing heartbeats only
STOP_BOUND_S = HEARTBEAT_TIMEOUT_S + 5.0
#: four replicas of two ranks on a loaded 2-core machine
START_TIMEOUT_S = 240.0
_SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "segv": signal.SIGSEGV, "sigstop": signal.SIGSTOP}
_EXPECTED_EXIT = {"sigkill": "SIGKILL", "sigterm": "SIGTERM", "segv": "SIGSEGV", "exit": "code 1",
                  "sigstop": "no heartbeat"}

#: the pool of this module while it is in use (tests that count fds wait for its background start)
STARTING: list = []
#: what each case measured; written as JSON to $PHYRT_FIGURES_DIR/kill_matrix.json when set
FIGURES: list[dict[str, Any]] = []


# --------------------------------------------------------------------------- engines


@dataclass
class Slot:
    """One replica handed to one case, and the engine's witness replica."""

    engine: Any
    victim: int
    witness: int
    pids: list[int]


class ReplicaPool:
    """Engines of ``REPLICAS_PER_ENGINE`` replicas, one replica per case, the last one kept
    as the witness. The next engine starts in the background as soon as the current one
    cannot cover the cases left, so that rank start-up overlaps the cases (which mostly
    wait: for heartbeats to lapse, for the reaper's grace).

    Because an engine may be starting meanwhile, leaks are accounted per run, not by
    this process's total fd count (the module checks that at its ends): a retired
    engine leaves no socket fd under its run directory and none of its ranks' spawn
    pipes open (``close()`` itself releases them: no gc pass is needed).
    """

    def __init__(self, victims: int) -> None:
        self.remaining = victims
        self.engine: Any = None
        self.used: set[int] = set()
        self.start_s: list[float] = []
        self._pipes: list[tuple[int, int]] = []  # (fd, inode) of the current engine's rank sentinels
        self._next: Future | None = None
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="kill-matrix-start")

    def take(self) -> Slot:
        healthy = self._healthy()
        if len(healthy) < 2:
            starting, self._next = self._next or self._starter.submit(self._start), None
            engine, seconds = starting.result(timeout=START_TIMEOUT_S)
            self.retire()
            self.engine, self.used = engine, set()
            self.start_s.append(seconds)
            sup = supervisor_of(engine)
            self._pipes = [(r.process.sentinel, os.fstat(r.process.sentinel).st_ino)
                           for g in sup._replicas for r in g.ranks]
            healthy = self._healthy()
        victim, witness = healthy[0], healthy[-1]
        self.used.add(victim)
        self.remaining -= 1
        if self._next is None and self.remaining > max(0, len(healthy) - 2):  # none when no case is left
            self._next = self._starter.submit(self._start)
        return Slot(self.engine, victim, witness, group_pids(self.engine, victim))

    @staticmethod
    def _start() -> tuple[Any, float]:
        started = time.monotonic()
        engine = start_engine("tests.plugins:KillProbe", parallel=tp_parallel(2), replicas=REPLICAS_PER_ENGINE,
                              heartbeat_interval_s=HEARTBEAT_INTERVAL_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        return engine, time.monotonic() - started

    def _healthy(self) -> list[int]:
        if self.engine is None:
            return []
        return [s.index for s in self.engine.replicas if s.healthy and s.index not in self.used]

    def retire(self) -> None:
        """Close the current engine: nothing of it may be left, its fds included."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        run_dir = supervisor_of(engine).run_dir
        close_engine(engine)  # ranks, run directory and segments gone
        del engine  # no gc pass: close() itself closes the ranks' Process objects (their spawn pipes)
        assert run_sockets(run_dir) == {}, run_sockets(run_dir)
        assert [fd for fd, inode in self._pipes if _inode(fd) == inode] == [], "spawn pipes of a closed engine"

    def close(self) -> None:
        starting, self._next = self._next, None
        if starting is not None:  # started for cases that did not run (a failure, -x)
            self.retire()
            self.engine = starting.result(timeout=START_TIMEOUT_S)[0]
        self.retire()
        self._starter.shutdown()


@pytest.fixture(scope="module")
def pool(request, no_leaks_at_module_end):
    resource_tracker.ensure_running()  # started once per process by the first spawn; not ours to count
    gc.collect()
    fds = _fds()
    replicas = ReplicaPool(sum("pool" in getattr(item, "fixturenames", ()) for item in request.session.items))
    STARTING.append(replicas)
    yield replicas
    STARTING.remove(replicas)
    out = os.environ.get("PHYRT_FIGURES_DIR")
    if out:
        with open(os.path.join(out, "kill_matrix.json"), "w") as f:
            json.dump({"cases": FIGURES, "engines": len(replicas.start_s), "engine_start_s": replicas.start_s}, f,
                      indent=1)
    replicas.close()
    gc.collect()
    assert wait_until(lambda: _fds() <= fds, 5.0), f"{_fds() - fds} file descriptors left by the module"


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _fds() -> int:
    return psutil.Process().num_fds()


def submit_to(engine: Any, replica: int, request: dict):
    """Submit ``request`` to one replica, as the dispatcher would have (in-flight count included)."""
    return engine._dispatcher.executors[replica].submit(request)


def shm_of(pids: list[int]) -> list[str]:
    """/dev/shm names created by any of ``pids`` (phyrt-RUN-PID-SEQ)."""
    found = []
    for name in os.listdir(conftest.SHM_DIR):
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == "phyrt" and parts[2].isdigit() and int(parts[2]) in pids:
            found.append(name)
    return sorted(found)


def followers() -> list[tuple[str, dict]]:
    """Requests queued behind the fatal one. Both need every rank (a collective), so the
    surviving rank cannot answer them alone; the 1 MiB tensor goes by shared memory."""
    return [("pid", {"op": "pid"}), ("reduce", {"op": "reduce", "x": torch.ones(1 << 18)})]


# --------------------------------------------------------------------------- the matrix


def provoke(slot: Slot, stage: str, how: str, rank: int) -> tuple[list[tuple[str, Any]], float, list[str]]:
    """Make the victim's rank ``rank`` die at ``stage``; returns the victim's futures, when the
    fatal step was taken (monotonic), and what was refused at submission already."""
    engine, victim = slot.engine, slot.victim
    die = {"op": "die", "stage": stage, "how": how, "ranks": [rank]}
    futures, refused = [], []
    if stage in ("plugin", "collective", "encode"):
        started = time.monotonic()
        futures.append(("die", submit_to(engine, victim, die)))
    elif stage == "decode":
        assert submit_to(engine, victim, die).result(60)["armed"] == [rank]
        started = time.monotonic()
    else:  # idle
        if how == "exit":  # only the rank itself can call os._exit: a thread of it does, while it idles
            assert submit_to(engine, victim, {**die, "after_s": 0.3}).result(60)["armed"] == [rank]
            assert wait_until(lambda: not pid_alive(slot.pids[rank]), 30), "the armed rank did not exit"
        else:
            os.kill(slot.pids[rank], _SIGNALS[how])
        started = time.monotonic()
    for name, request in followers():
        try:
            futures.append((name, submit_to(engine, victim, request)))
        except EngineUnavailableError as exc:  # the replica is known to be down already: fail fast
            assert f"replica {victim} is not serving" in str(exc), str(exc)
            refused.append(name)
    return futures, started, refused


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("how", DEATHS)
@pytest.mark.parametrize("stage", STAGES)
def test_a_rank_death_fails_its_replica_only_and_leaves_nothing(pool, stage, how, role):
    if (stage, role) in NOT_APPLICABLE:
        pool.remaining -= 1  # no replica needed
        pytest.skip(NOT_APPLICABLE[stage, role])
    slot = pool.take()
    engine, victim, witness, rank = slot.engine, slot.victim, slot.witness, ROLES[role]
    sup = supervisor_of(engine)
    sockets, run_shm, run_files = run_sockets(sup.run_dir), set(shm_names(sup.run_id)), set(os.listdir(sup.run_dir))
    finished: dict[str, float] = {}
    witness_future = submit_to(engine, witness, {"op": "sleep", "s": 1.0})  # runs across the death

    futures, started, refused = provoke(slot, stage, how, rank)
    for name, future in futures:
        future.add_done_callback(lambda _f, name=name: finished.setdefault(name, time.monotonic()))
    bound = STOP_BOUND_S if how == "sigstop" else BOUND_S
    for name, future in futures:
        try:
            exc = future.exception(timeout=max(0.01, started + bound - time.monotonic()))
        except TimeoutError:
            pytest.fail(f"{name!r} still pending {bound} s after the rank died ({stage}, {how}, {role})")
        assert isinstance(exc, EngineUnavailableError), f"{name!r}: {exc!r}"
        assert f"replica {victim} failed" in str(exc), str(exc)
    fail_s = max((finished[n] - started for n, _ in futures if n in finished), default=0.0)
    assert wait_until(lambda: not any(pid_alive(p) for p in slot.pids), REAP_GRACE_S), \
        f"ranks of the failed replica still alive: {[p for p in slot.pids if pid_alive(p)]}"
    reaped_s = time.monotonic() - started

    # the replica is out for good; the others served meanwhile and serve on
    status = engine.replicas[victim]
    assert not status.healthy and status.error, status
    assert witness_future.result(60)["replica"] == witness
    assert engine.step({"op": "pid"}, timeout=60)["replica"] != victim

    # nothing else of the victim is left: its connections are closed, no segment (its broadcast
    # ring's name went once its ranks were ready), no run-dir file
    def gone() -> bool:  # each rank: a control DEALER on ctl and a heartbeat DEALER on hb
        now = run_sockets(sup.run_dir)
        return all(now.get((name, "conn"), 0) <= sockets.get((name, "conn"), 0) - len(slot.pids)
                   for name in ("ctl", "hb"))

    assert wait_until(gone, 5.0), (sockets, run_sockets(sup.run_dir))
    assert shm_of(slot.pids) == []
    assert set(shm_names(sup.run_id)) <= run_shm, set(shm_names(sup.run_id)) - run_shm
    assert set(os.listdir(sup.run_dir)) <= run_files, set(os.listdir(sup.run_dir)) - run_files

    blamed = f"rank {rank} " in status.error and _EXPECTED_EXIT[how] in status.error
    FIGURES.append({"stage": stage, "how": how, "role": role, "fail_s": round(fail_s, 3),
                    "reaped_s": round(reaped_s, 3), "refused_at_submit": refused, "reason": status.error[:200],
                    "blames_the_dead_rank": blamed})
    # the replica's error names the rank that died and how (not its surviving peer, nor "exited")
    assert blamed, f"expected 'rank {rank} ... {_EXPECTED_EXIT[how]}': {status.error!r}"


# --------------------------------------------------------------------------- bugs once shown (were strict xfails)


# Was a bug (fixed; this guards it): WorkerSupervisor._fail_group neither sweeps the dead ranks'
# segments nor releases the failed group's request arena; runtime/transport/arena.py asks for a sweep 'at
# start and after a group dies'. A request that grew the arena (tensor > 8 MiB) and was in flight
# when its group failed keeps its segment name phyrt-RUN-ENGINEPID-N (16 MiB of tmpfs) in /dev/shm
# until Engine.close()
def test_a_failed_group_leaves_no_name_of_its_request_in_flight(pool, tmp_path):
    slot = pool.take()
    sup = supervisor_of(slot.engine)
    before = set(shm_names(sup.run_id))
    trigger = tmp_path / "die"  # rank 1 waits for it inside the decoding of the next request
    assert submit_to(slot.engine, slot.victim, {"op": "die", "stage": "decode", "how": "sigkill", "ranks": [1],
                                                "die_when": str(trigger)}).result(60)["armed"] == [1]
    # 12 MiB does not fit the replica's 8 MiB request arena: it grows by a fresh, named segment
    future = submit_to(slot.engine, slot.victim, {"op": "reduce", "x": torch.ones(3 << 20)})
    grown = set(shm_names(sup.run_id)) - before  # named until every rank has mapped it: rank 1 never will
    assert grown, "the request did not grow the arena by a named segment: nothing for the failure to leave"
    trigger.touch()
    assert isinstance(future.exception(timeout=BOUND_S), EngineUnavailableError)
    assert "rank 1 was killed by signal SIGKILL" in str(future.exception()), str(future.exception())
    assert wait_until(lambda: not any(pid_alive(p) for p in slot.pids), REAP_GRACE_S)
    # (the failed group's segments are unlinked when it fails, or never: a moment's grace)
    wait_until(lambda: not set(shm_names(sup.run_id)) - before, 1.0)
    left = set(shm_names(sup.run_id)) - before
    assert left == set(), f"names left in /dev/shm by the failed group while the engine serves on: {left}"


# Was a bug (fixed; this guards it): a rank that dies after growing its result arena (a result > 8
# MiB placed, not yet sent) leaves the new segment's name phyrt-RUN-RANKPID-N in /dev/shm for as
# long as the engine runs: the supervisor does not sweep the names of a failed group's dead ranks
# (runtime/transport/arena.py: 'call one of them at start and after a group dies')
def test_a_rank_that_dies_with_a_large_reply_placed_leaves_no_name(pool, tmp_path):
    slot = pool.take()
    placed = tmp_path / "placed"  # the rank writes the segment of its placement there, then dies
    assert submit_to(slot.engine, slot.victim, {"op": "die", "stage": "reply_shm", "how": "sigkill", "ranks": [0],
                                                "placed_mark": str(placed)}).result(60)["armed"] == [0]
    future = submit_to(slot.engine, slot.victim, {"op": "echo", "x": torch.ones(3 << 20)})  # 12 MiB back
    assert isinstance(future.exception(timeout=BOUND_S), EngineUnavailableError)
    assert "rank 0 was killed by signal SIGKILL" in str(future.exception()), str(future.exception())
    # it died right after placing its result in a segment of its own (named phyrt-RUN-RANKPID-N)
    segment = placed.read_text() if placed.exists() else None
    assert segment is not None and segment.split("-")[2] == str(slot.pids[0]), segment
    assert wait_until(lambda: not any(pid_alive(p) for p in slot.pids), REAP_GRACE_S)
    wait_until(lambda: not shm_of(slot.pids), 1.0)  # swept when the group fails, or never: a moment's grace
    assert not os.path.exists(os.path.join(conftest.SHM_DIR, segment))
    assert shm_of(slot.pids) == [], f"names of dead ranks left in /dev/shm: {shm_of(slot.pids)}"


# Was a bug (fixed; this guards it): when the engine process is busy for a moment (here: the GIL
# held 3 s, as any long C call in a caller thread does) while a rank dies inside a collective, the
# supervisor drains the ROUTER before it looks at the rank sentinels, so the surviving rank's gloo
# error wins: the replica fails with 'rank 0 raised RuntimeError:
# [.../gloo/transport/tcp/pair.cc:...] ... Connection reset by peer' instead of 'rank 1 was killed
# by signal SIGKILL', the cause is a RemoteError, and runtime.serving.server answers clients PluginError
# (not EngineUnavailable) for a killed rank
def test_a_rank_killed_in_a_collective_is_blamed_even_when_the_engine_is_busy(pool, tmp_path):
    from runtime.serving.outcomes import _error_of

    slot = pool.take()
    mark, trigger = str(tmp_path / "looping"), tmp_path / "die"
    future = submit_to(slot.engine, slot.victim, {"op": "die", "stage": "collective", "how": "sigkill",
                                                  "ranks": [1], "die_when": str(trigger), "after_s": 0.7,
                                                  "mark": mark})
    # both ranks loop in all_reduce; rank 1 kills itself 0.7 s after the trigger appears
    assert wait_until(lambda: len(mark_files(mark)) == 2, 30), mark_files(mark)
    assert pid_alive(slot.pids[1]) and not future.done()
    trigger.touch()
    # meanwhile the supervisor's I/O thread waits for the GIL (a heartbeat has woken its poll by the
    # time rank 1 dies), and rank 0 reports the collective's error: both wait for it when the GIL comes
    # back; 2 s, well short of the 4 s heartbeat timeout
    _hold_gil(2.0)
    # the race took place: rank 1 died while this process held the GIL (no thread of it ran meanwhile)
    assert not pid_alive(slot.pids[1]), "rank 1 was still alive when the engine was busy no more"
    exc = future.exception(timeout=BOUND_S + STOP_BOUND_S)
    assert isinstance(exc, EngineUnavailableError), repr(exc)
    assert wait_until(lambda: not any(pid_alive(p) for p in slot.pids), REAP_GRACE_S)
    reply_type, reply_message = _error_of(exc)
    assert "rank 1 was killed by signal SIGKILL" in str(exc), str(exc)
    assert not isinstance(exc.__cause__, RemoteError), repr(exc.__cause__)
    assert reply_type == "EngineUnavailable", (reply_type, reply_message)


# Was a bug (fixed; this guards it): Engine.close() leaves 2 pipe fds per rank open
# (multiprocessing's Popen sentinel and preparation pipe: the supervisor never calls
# Process.close() on its ranks); they go only when the engine's reference cycle is garbage-
# collected, i.e. at an unpredictable later gc pass
def test_close_returns_every_file_descriptor_without_the_garbage_collector(no_leaks):
    for replicas in STARTING:  # an engine the pool starts for later cases opens fds meanwhile: let it finish
        if replicas._next is not None:
            replicas._next.result(timeout=START_TIMEOUT_S)
    resource_tracker.ensure_running()
    gc.collect()
    before = _fds()
    gc.disable()  # what close() itself releases, not what a gc pass happens to
    try:
        engine = start_engine("tests.plugins:KillProbe", parallel=tp_parallel(2))
        assert engine.step({"op": "pid"}, timeout=60)["replica"] == 0
        close_engine(engine)
        del engine
        left = _fds() - before
    finally:
        gc.enable()
        gc.collect()
    assert left <= 0, f"{left} file descriptors still open after close(); {_fds() - before} after a gc pass"


# Was a bug (fixed; this guards it, now that requests go through the broadcast ring, whose writes
# never block): WorkerSupervisor.submit sent to every rank's inbox PUSH with
# a blocking send while holding _submit_lock. Once a rank has died, libzmq drops its inbox
# connection and a PUSH with no peer blocks; if a submit lands after that but before the I/O
# thread has failed the group (it is busy for a moment, here: waiting on another replica's arena
# lock), the submit blocks forever holding _submit_lock, then the I/O thread blocks in _fail_group
# on that lock: no replica is served any more and Engine.close() (which takes _submit_lock) never
# returns. bench.soak hits it unprovoked: a server whose I/O thread hangs in inbox.send
# (supervisor.py submit), its supervisor thread in _fail_group, its main thread in
# RequestDispatcher.close, and which SIGTERM cannot stop
@pytest.mark.timeout(180)
def test_a_submit_racing_a_rank_death_neither_blocks_nor_wedges_the_engine():
    engine = start_engine("tests.plugins:KillProbe", parallel=tp_parallel(2), replicas=2, heartbeat_timeout_s=60.0)
    sup = supervisor_of(engine)
    victim, witness = 0, 1
    pids = group_pids(engine, victim)
    # the lock the I/O thread takes after completing a witness's request: watched, to see it wait
    busy = sup._replicas[witness].arena_lock = WatchedLock()
    outcome: dict[str, Any] = {}

    def submit() -> None:
        try:
            outcome["future"] = submit_to(engine, victim, {"op": "pid"})
        except EngineUnavailableError as exc:  # refused at once: as good as a failed future
            outcome["refused"] = exc

    try:
        with busy:  # the I/O thread will wait for this lock when the witness's request is done
            # waited on without result(): a caller in result() would read the answers itself,
            # and this thread, holding the lock, would stall instead of the I/O thread
            stalled = submit_to(engine, witness, {"op": "sleep", "s": 0.2})
            assert wait_until(stalled.done, 30) and stalled.result()["replica"] == witness
            assert busy.contended.wait(10), "the I/O thread did not stall on the lock"  # the "done" is in
            os.kill(pids[1], signal.SIGKILL)
            assert wait_until(lambda: not pid_alive(pids[1]), 10)
            # the stalled I/O thread cannot fail the group: the submit writes to a ring one of whose
            # readers is dead (its message waits there, or in the engine once the ring is full)
            assert engine.replicas[victim].healthy, "the group failed before the submit: no race"
            caller = threading.Thread(target=submit, daemon=True)
            caller.start()
            caller.join(5)
        submit_returned = not caller.is_alive()
        victim_failed = wait_until(lambda: not engine.replicas[victim].healthy, 10)
        served = _step_within(engine, 10)
        # expected: the submit returns, the dead rank's replica fails, the witness serves on
        assert {"submit returned": submit_returned, "victim failed": victim_failed, "witness served": served} \
            == {"submit returned": True, "victim failed": True, "witness served": True}
        if "future" in outcome:  # it went into a dying connection: the group's failure fails it
            assert isinstance(outcome["future"].exception(timeout=15), EngineUnavailableError)
    finally:
        close_engine(engine)  # closes the ranks' Process objects too (no gc pass needed)


def _step_within(engine: Any, timeout: float) -> bool:
    """Whether the engine serves a request within ``timeout`` (asked from a thread that may block)."""
    answered = threading.Event()

    def ask() -> None:
        try:
            engine.step({"op": "pid"}, timeout=timeout)
            answered.set()
        except Exception:  # noqa: BLE001 - not served, which is what is asked
            pass

    threading.Thread(target=ask, daemon=True).start()
    return answered.wait(timeout + 1)


def test_the_ranks_collectives_run_on_shared_memory(pool):
    """What the collective cases kill a rank inside: each rank of a tp-2 replica maps its world
    group's shared-memory segment, whose name is already gone (the segment of group rank 0)."""
    from runtime.parallel.shm_setup import segment_bytes

    slot = pool.take()
    run_id = supervisor_of(slot.engine).run_id
    for pid in slot.pids:
        with open(f"/proc/{pid}/maps") as f:
            spans = {line.split()[0] for line in f
                     if f"/dev/shm/phyrt-{run_id}-{slot.pids[0]}-" in line and line.rstrip().endswith("(deleted)")}
        sizes = [int(end, 16) - int(start, 16) for start, end in (span.split("-") for span in spans)]
        assert segment_bytes(2) in sizes, (pid, sizes)
    reduced = submit_to(slot.engine, slot.victim, {"op": "reduce", "x": torch.ones(1 << 18)}).result(60)
    assert reduced == {"sum": 2.0 * (1 << 18), "replica": slot.victim}


def test_the_matrix_covered_every_stage_way_and_role():
    """Last in the module (so the pool's leak checks at module end report as errors of a
    plain test, not of an xfail): every case that ran left its figures."""
    ran = {(f["stage"], f["how"], f["role"]) for f in FIGURES}
    if not ran:
        pytest.skip("no matrix case ran in this session")
    every = {(s, h, r) for s in STAGES for h in DEATHS for r in ROLES if (s, r) not in NOT_APPLICABLE}
    if len(ran) < len(every):
        pytest.skip(f"{len(every) - len(ran)} matrix cases deselected or failed")
