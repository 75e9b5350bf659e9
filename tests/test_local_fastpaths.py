"""The short paths of a local replica's round trip, each next to the behaviour it keeps.

- A one-rank group's submit sends without the POLLOUT check (its NOBLOCK send goes
  out whole or not at all): a submit racing that rank's death neither blocks nor is
  lost, while the supervisor's I/O thread is stalled (as in the kill matrix's race).
- The I/O thread completes futures at the end of its loop iteration, after taking the
  answer, and gives the request arena's blocks back right after: every answer arrives,
  tensors through shared memory or inline, from concurrent callers, and every block
  goes back.
- A caller waiting on its own answer (``Engine.step``, or ``result()`` when no other
  thread reads) reads it itself: it needs no other thread of the engine, it completes
  other callers' futures it reads meanwhile, a step that times out hands the reading
  on, and a rank's death reaches it at once; waiting on a long request, it sleeps
  (after at most a short poll). A rank polls a moment for its next request after each
  answer, only when the ranks leave a core free, and then sleeps.
- ``EngineCore.run``, the rank's one-call path for an executing runner, is ``add``
  then ``step``; ``runtime.core.futures.resolve`` completes once and never raises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator

import pytest
import torch

from runtime import EngineUnavailableError
from tests.conftest import (WatchedLock, close_engine, group_pids, pid_alive, polls, start_engine,
                            supervisor_of, wait_until)
from tests.plugins import mark_files

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def _module_end(no_leaks_at_module_end):
    yield


def submit_to(engine: Any, replica: int, request: dict) -> Future:
    return engine._dispatcher.executors[replica].submit(request)


def arena_blocks_in_use(engine: Any) -> int:
    return sum(len(seg.used) for g in supervisor_of(engine)._replicas for seg in g.arena._segments.values())


@pytest.mark.usefixtures("no_leaks")
def test_answers_inline_and_through_shared_memory_all_arrive_and_every_block_goes_back():
    engine = start_engine(replicas=2)  # two one-rank replicas
    try:
        small = torch.arange(8, dtype=torch.float32)
        large = torch.arange(64 << 10, dtype=torch.float32)  # 256 KiB: through the request arena
        errors: list[BaseException] = []

        def caller(k: int) -> None:
            try:
                for i in range(40):
                    x = (large if (i + k) % 3 == 0 else small) + i
                    got = engine.step({"op": "echo", "x": x}, timeout=60)
                    assert torch.equal(got, x), (k, i)
            except BaseException as exc:  # reported below, with the others
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(100)
        assert not errors, errors
        assert all(s.healthy for s in engine.replicas)
        assert wait_until(lambda: all(s.inflight == 0 for s in engine.replicas), 5)
        assert wait_until(lambda: arena_blocks_in_use(engine) == 0, 5), arena_blocks_in_use(engine)
    finally:
        close_engine(engine)


@pytest.mark.timeout(180)
def test_a_submit_racing_a_one_rank_groups_death_neither_blocks_nor_is_lost():
    engine = start_engine(replicas=2, heartbeat_timeout_s=60.0)
    sup = supervisor_of(engine)
    victim, witness = 0, 1
    [pid] = group_pids(engine, victim)
    # the lock the I/O thread takes after completing a witness's request: watched, to see it wait
    busy = sup._replicas[witness].arena_lock = WatchedLock()
    outcome: dict[str, Any] = {}

    def submit() -> None:
        try:
            outcome["future"] = submit_to(engine, victim, {"op": "pid"})
        except EngineUnavailableError as exc:  # refused at once: as good as a failed future
            outcome["refused"] = exc

    try:
        with busy:  # once the witness's answer is completed, the I/O thread waits for this lock
            # waited on without result(): a caller in result() would read the answer itself,
            # and this thread, holding the lock, would stall instead of the I/O thread
            stalled = submit_to(engine, witness, {"op": "sleep", "s": 0.2})
            assert wait_until(stalled.done, 30) and stalled.result()["replica"] == witness
            assert busy.contended.wait(10), "the I/O thread did not stall on the lock"
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: not pid_alive(pid), 10)  # its ring has no reader left
            assert engine.replicas[victim].healthy, "the group failed before the submit: no race"
            caller = threading.Thread(target=submit, daemon=True)
            caller.start()
            caller.join(5)
            submit_returned = not caller.is_alive()
        assert submit_returned
        if "future" in outcome:  # it went into a dying connection: the group's failure fails it
            assert isinstance(outcome["future"].exception(timeout=15), EngineUnavailableError)
        assert wait_until(lambda: not engine.replicas[victim].healthy, 10)
        assert engine.step({"op": "pid"}, timeout=30)["replica"] == witness
    finally:
        close_engine(engine)


def test_engine_core_run_is_add_then_step():
    from runtime.core.config import EngineConfig
    from runtime.core.plugins import Entry
    from runtime.execution.engine_core import EngineCore, make_context

    class Runner:
        def execute(self, request: Any) -> Any:
            if request == "boom":
                raise ZeroDivisionError("boom")
            return 2 * request

    class Doubler(Entry):
        def build(self, ctx: Any, plugin_args: Any) -> Any:
            return Runner()

    core = EngineCore(Doubler(), None, make_context(EngineConfig()))
    assert not core.stepped
    assert core.run(7, 21) == [(7, 42, None)]
    core.add(8, 21)
    assert core.step() == [(8, 42, None)] and not core.has_unfinished()
    [(request_id, result, error)] = core.run(9, "boom")
    assert (request_id, result, type(error), str(error)) == (9, None, ZeroDivisionError, "boom")


def test_resolve_completes_once_and_never_raises():
    from runtime.core.futures import resolve

    done: Future = Future()
    resolve(done, result=1)
    resolve(done, error=RuntimeError("late"))
    resolve(done, result=2)
    assert done.result(0) == 1
    failed: Future = Future()
    resolve(failed, error=RuntimeError("first"))
    resolve(failed, result=3)
    assert str(failed.exception(0)) == "first"
    cancelled: Future = Future()
    assert cancelled.cancel()
    resolve(cancelled, result=4)
    resolve(cancelled, error=RuntimeError("x"))
    assert cancelled.cancelled()


# --------------------------------------------------------------------------- the reader role


@contextlib.contextmanager
def local_engine(**settings: Any) -> Iterator[Any]:
    engine = start_engine(**settings)
    try:
        yield engine
    finally:
        close_engine(engine)


def stall_io_thread(sup: Any) -> tuple[threading.Event, threading.Event]:
    """Make the supervisor's I/O thread block at its next deadline check (it checks every
    heartbeat_interval_s / 2) until the returned ``release`` is set; ``stuck`` is set once it blocks."""
    release, stuck, check = threading.Event(), threading.Event(), sup._check_deadlines

    def stalled(now: float) -> float:
        if threading.get_ident() == sup._link.thread.ident:
            stuck.set()
            release.wait(60)
        return check(now)

    sup._check_deadlines = stalled
    return release, stuck


@pytest.mark.usefixtures("no_leaks")
def test_a_caller_in_step_reads_its_own_answer_while_other_futures_are_read_for_it(tmp_path):
    with local_engine(replicas=2, heartbeat_interval_s=0.1) as engine:
        sup = supervisor_of(engine)
        release, stuck = stall_io_thread(sup)
        assert stuck.wait(10), "the I/O thread did not stall"
        # step(): the caller reads the answer itself; the stalled I/O thread is not needed
        x = torch.arange(4.0)
        for _ in range(20):
            assert torch.equal(engine.step({"op": "echo", "x": x}, timeout=10), x)
        # a future nobody waits on is read by the I/O thread: it waits for it
        seen: list = []
        mark = str(tmp_path / "pid")
        future = engine.submit({"op": "pid", "mark": mark})
        future.add_done_callback(lambda f: seen.append(f.result()["replica"]))
        assert wait_until(lambda: mark_files(mark), 10)  # its ranks run it, and answer a moment later:
        time.sleep(0.2)  # the answer waits in the socket, where only a reader takes it
        assert not future.done()
        # ... unless a caller in step() reads meanwhile: it completes that future too
        assert engine.step({"op": "sleep", "s": 0.2}, timeout=10)["replica"] in (0, 1)
        assert wait_until(future.done, 5) and seen == [future.result()["replica"]]
        release.set()
        # with the I/O thread back, futures nobody waits on complete by themselves
        futures = [engine.submit({"op": "echo", "x": x + i}) for i in range(8)]
        assert wait_until(lambda: all(f.done() for f in futures), 10)
        assert all(torch.equal(f.result(), x + i) for i, f in enumerate(futures))
        assert sup._role.holder is None


@pytest.mark.usefixtures("no_leaks")
def test_a_step_that_times_out_hands_the_reading_on():
    with local_engine(replicas=2) as engine:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="still running"):
            engine.step({"op": "sleep", "s": 1.5}, timeout=0.2)
        assert time.monotonic() - started < 0.9
        # another request goes to the idle replica and is answered meanwhile, while the late one runs
        assert engine.step({"op": "pid"}, timeout=10)["replica"] in (0, 1)
        assert sorted(s.inflight for s in engine.replicas) == [0, 1], engine.replicas
        # the late answer is still read (by whoever reads): nothing stays in flight
        assert wait_until(lambda: all(s.inflight == 0 for s in engine.replicas), 5), engine.replicas
        # and the reading is free: a future nobody waits on completes by itself
        future = engine.submit({"op": "pid"})
        assert wait_until(future.done, 5) and future.result()["replica"] in (0, 1)


@pytest.mark.usefixtures("no_leaks")
def test_a_rank_death_reaches_a_caller_reading_in_step_at_once(tmp_path):
    engine = start_engine(replicas=1, heartbeat_timeout_s=60.0)
    [pid] = group_pids(engine, 0)
    outcome: dict[str, Any] = {}
    mark = str(tmp_path / "running")

    def call() -> None:
        try:
            engine.step({"op": "sleep", "s": 30.0, "mark": mark}, timeout=60)
        except BaseException as exc:
            outcome["error"], outcome["at"] = exc, time.monotonic()

    try:
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        # its request runs on the rank, and the caller sleeps in poll(2): it reads the ranks' socket
        # itself (a caller that waits for another thread to read sleeps on a lock instead)
        assert wait_until(lambda: mark_files(mark) and polls(caller), 10), (mark_files(mark), outcome)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        caller.join(10)
        assert isinstance(outcome.get("error"), EngineUnavailableError), outcome
        assert "SIGKILL" in str(outcome["error"])
        assert outcome["at"] - killed < 2.0
        with pytest.raises(EngineUnavailableError):
            engine.step({"op": "pid"}, timeout=10)
    finally:
        close_engine(engine)


@pytest.mark.usefixtures("no_leaks")
def test_a_caller_waiting_on_a_long_request_does_not_burn_a_core():
    with local_engine(replicas=1) as engine:
        engine.step({"op": "pid"}, timeout=30)
        cpu = time.thread_time()
        assert engine.step({"op": "sleep", "s": 0.5}, timeout=30)["replica"] == 0
        # at most the short poll before sleeping (runtime.transport.spin.BUDGETS_US["caller"], 100 µs), plus the round
        # trip's own work: not half a second of polling
        assert time.thread_time() - cpu < 0.1


@pytest.mark.usefixtures("no_leaks")
def test_a_rank_looks_for_its_next_request_a_moment_after_answering_then_sleeps():
    """Each rank polls for up to BUDGETS_US["worker"] after an answer when the ranks leave the engine
    process a core (0 otherwise), and sleeps after it: an idle rank costs no CPU."""
    import psutil

    from runtime.transport.spin import BUDGETS_US

    cores = len(os.sched_getaffinity(0))
    with local_engine(replicas=1) as engine:
        sup = supervisor_of(engine)
        assert sup.worker_spin_ns == (BUDGETS_US["worker"] * 1000 if cores > 1 else 0)
        [pid] = group_pids(engine, 0)
        rank = psutil.Process(pid)
        for _ in range(20):
            engine.step({"op": "pid"}, timeout=30)
        time.sleep(0.1)
        before = rank.cpu_times()
        time.sleep(1.0)
        after = rank.cpu_times()
        assert (after.user + after.system) - (before.user + before.system) < 0.1
    if cores > 1:
        with local_engine(replicas=cores) as engine:  # a rank per core: nothing to spare
            assert supervisor_of(engine).worker_spin_ns == 0


@pytest.mark.usefixtures("no_leaks")
def test_a_step_whose_request_failed_before_it_waited_leaves_the_reading_to_others():
    """Engine.step's start takes the reading for its thread before it sends; a request failed
    before that thread waits must not keep the role (nobody would read the other replica's answers)."""
    with local_engine(replicas=2, heartbeat_timeout_s=60.0) as engine:
        sup = supervisor_of(engine)
        victim = engine._dispatcher.executors[0]
        [pid] = group_pids(engine, 0)
        # the I/O thread takes the role a moment to give result blocks of the warm-up back: a
        # step takes it only when it is free
        assert wait_until(lambda: sup._role.holder is None and not any(g.frees for g in sup._replicas), 10)
        victim.reserve()
        call = victim.start_call({"op": "sleep", "s": 30.0})  # as Engine.step sends
        slot, owned = call
        assert owned == 1 and sup._role.holder == threading.get_ident()
        os.kill(pid, signal.SIGKILL)
        assert wait_until(slot.done, 10)  # failed before this thread waits on it
        with pytest.raises(EngineUnavailableError):
            victim.finish_call(call, 5)
        assert sup._role.holder is None
        # a future of the other replica that nobody waits on is read (by the I/O thread)
        other = submit_to(engine, 1, {"op": "pid"})
        assert wait_until(other.done, 10) and other.result()["replica"] == 1
