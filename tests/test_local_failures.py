"""Local replicas that fail on purpose: a rank SIGKILLed, SIGSTOPped, exiting,
raising, sending garbage; requests that overrun ``execution_timeout_s``; a plugin
that fails in ``build``.

Every failure takes a whole replica down for good, so the destructive tests draw
replicas from a shared two-replica engine (``casualties(n)`` hands out an engine
with at least ``n`` healthy replicas and starts a new one only when needed).
Failures that need their own supervisor settings get their own small engine.
After every test, ``tests/conftest.py`` checks that the failed groups' ranks are
gone and that closed runs left no segment or run directory.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from runtime import EngineUnavailableError, ProtocolError, RemoteError, WorkerStartupError
from runtime.transport import wire
from tests import conftest
from tests.conftest import (REAP_GRACE_S, child_pids, close_engine, leftovers, pid_alive, start_engine,
                            tp_parallel, wait_until)
from tests.plugins import mark_files

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]

_pool: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _module_end(no_leaks_at_module_end):
    yield
    engine = _pool.pop("engine", None)
    if engine is not None and id(engine) in conftest.LIVE:
        close_engine(engine)


def casualties(need: int):
    """A shared engine (two replicas of dense tp 2) with at least ``need`` healthy replicas."""
    engine = _pool.get("engine")
    if engine is None or sum(s.healthy for s in engine.replicas) < need:
        if engine is not None:
            close_engine(engine)
        engine = _pool["engine"] = start_engine(parallel=tp_parallel(2), replicas=2)
    return engine


def healthy(engine) -> list[int]:
    return [s.index for s in engine.replicas if s.healthy]


def pids_by_replica(engine) -> dict[int, list[int]]:
    """Every healthy replica's rank pids, asked of the ranks themselves."""
    want, found = healthy(engine), {}
    for _ in range(2 * len(want)):
        answer = engine.step({"op": "pid"}, timeout=30)
        found[answer["replica"]] = [row[0] for row in answer["pids"]]
        if sorted(found) == want:
            return found
    raise AssertionError(f"replicas {want} did not all answer: {found}")


def submit_to(engine, request: dict):
    """Submit; return the future and the replica it went to (seen as its in-flight count rising).

    Only for requests that cannot finish meanwhile (long sleeps)."""
    before = [s.inflight for s in engine.replicas]
    future = engine.submit(request)
    after = [s.inflight for s in engine.replicas]
    [replica] = [i for i, (a, b) in enumerate(zip(before, after)) if b == a + 1]
    return future, replica


def failure_of(future, timeout: float) -> EngineUnavailableError:
    exc = future.exception(timeout=timeout)  # TimeoutError if the future is still pending
    assert isinstance(exc, EngineUnavailableError), repr(exc)
    return exc


def assert_group_gone(pids: list[int]) -> None:
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), REAP_GRACE_S), \
        f"ranks of the failed group still alive: {[p for p in pids if pid_alive(p)]}"


# --------------------------------------------------------------------------- a rank dies


def test_sigkill_mid_request_fails_that_replica_within_1s_and_the_other_serves(tmp_path):
    engine = casualties(2)
    pids = pids_by_replica(engine)
    mark = str(tmp_path / "running")
    jobs = [submit_to(engine, {"op": "sleep", "s": 1.5, "mark": mark}) for _ in range(4)]
    assert sorted(r for _, r in jobs) == [0, 0, 1, 1]  # one running and one queued on each replica
    victim = jobs[0][1]
    other = 1 - victim
    # the first request of each replica is inside the plugin on both of its ranks now
    assert wait_until(lambda: len(mark_files(mark)) == 4, 30), mark_files(mark)
    assert not any(future.done() for future, _ in jobs)

    killed_at = time.monotonic()
    os.kill(pids[victim][1], signal.SIGKILL)
    for future, replica in jobs:
        if replica == victim:  # failed within 1 s of the kill (else failure_of's wait raises TimeoutError)
            exc = failure_of(future, max(0.01, killed_at + 1.0 - time.monotonic()))
            assert f"replica {victim}" in str(exc) and "rank 1" in str(exc) and "SIGKILL" in str(exc), str(exc)

    status = engine.replicas[victim]
    assert not status.healthy and "rank 1" in status.error and "SIGKILL" in status.error
    for future, replica in jobs:
        if replica == other:
            assert future.result(30)["replica"] == other
    assert [engine.step({"op": "pid"}, timeout=30)["replica"] for _ in range(3)] == [other] * 3
    assert_group_gone(pids[victim])  # the surviving rank of the failed group is stopped too
    assert all(pid_alive(p) for p in pids[other])


def test_plugin_exception_fails_the_group_with_the_remote_error_chained():
    engine = casualties(1)
    before = healthy(engine)
    pids = pids_by_replica(engine)
    # rank 1 raises; rank 0 waits in a barrier that rank 1 never joins, as real ranks would
    future, victim = submit_to(engine, {"op": "raise", "ranks": [1], "message": "on purpose"})
    exc = failure_of(future, 30)
    assert f"replica {victim}" in str(exc) and "rank 1" in str(exc), str(exc)
    assert "ZeroDivisionError" in str(exc) and "on purpose" in str(exc), str(exc)
    cause = exc.__cause__
    assert isinstance(cause, RemoteError), repr(cause)
    assert cause.remote_type == "ZeroDivisionError" and cause.remote_message == "on purpose"
    assert "tests/plugins.py" in cause.remote_traceback and "raise ZeroDivisionError" in cause.remote_traceback

    # out of the rotation for good
    assert not engine.replicas[victim].healthy
    assert "ZeroDivisionError" in engine.replicas[victim].error
    rest = [i for i in before if i != victim]
    if rest:
        assert {engine.step({"op": "pid"}, timeout=30)["replica"] for _ in range(3)} == set(rest)
    else:
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="no healthy replica"):
            engine.submit({"op": "pid"})
        assert time.monotonic() - started < 0.5
    assert_group_gone(pids[victim])


def test_multipart_message_from_a_rank_fails_the_group():
    engine = casualties(1)
    future, victim = submit_to(engine, {"op": "send_raw", "ranks": [1], "frames": [b"two", b"frames"],
                                        "then_sleep": 1.0})
    outcome = future.exception(timeout=30)
    assert isinstance(outcome, EngineUnavailableError) and "malformed" in str(outcome), \
        f"the request finished normally (outcome {outcome!r}); replica {victim} healthy: " \
        f"{engine.replicas[victim].healthy}"


def test_a_rank_exit_is_reported_with_its_code():
    engine = casualties(1)
    pids = pids_by_replica(engine)
    future, victim = submit_to(engine, {"op": "exit", "ranks": [0], "code": 3})
    exc = failure_of(future, 30)
    assert f"replica {victim}" in str(exc) and "rank 0 exited with code 3" in str(exc), str(exc)
    assert not engine.replicas[victim].healthy
    assert_group_gone(pids[victim])


def test_malformed_message_from_a_rank_fails_the_group():
    engine = casualties(1)
    pids = pids_by_replica(engine)
    # rank 1 sends bytes that are not a message on its own control connection, then stays busy
    future, victim = submit_to(engine, {"op": "send_raw", "ranks": [1], "frames": [b"garbage"]})
    exc = failure_of(future, 30)
    assert f"replica {victim}" in str(exc) and "rank 1" in str(exc) and "malformed" in str(exc), str(exc)
    assert isinstance(exc.__cause__, ProtocolError)
    assert not engine.replicas[victim].healthy
    assert_group_gone(pids[victim])


def test_answer_to_an_unknown_request_fails_the_group():
    engine = casualties(1)
    pids = pids_by_replica(engine)
    forged = wire.pack_message("done", 987654321, ok=True)
    future, victim = submit_to(engine, {"op": "send_raw", "ranks": [1], "frames": [forged]})
    exc = failure_of(future, 30)
    assert "rank 1" in str(exc) and "malformed" in str(exc) and "987654321" in str(exc), str(exc)
    assert not engine.replicas[victim].healthy
    assert_group_gone(pids[victim])


def test_an_unencodable_result_is_reported_with_its_type_and_message():
    engine = casualties(1)
    future, victim = submit_to(engine, {"op": "unencodable"})
    exc = failure_of(future, 30)
    assert not engine.replicas[victim].healthy
    assert "TypeError" in str(exc) and "cannot encode set" in str(exc), str(exc)


def test_malformed_ready_from_one_rank_fails_only_its_group():
    engine = casualties(2)
    pids = pids_by_replica(engine)
    forged = wire.pack_message("ready", 1, segments=5)
    future, victim = submit_to(engine, {"op": "send_raw", "ranks": [1], "frames": [forged], "then_sleep": 5.0})
    exc = failure_of(future, 30)
    assert "rank 1" in str(exc) and "malformed" in str(exc), str(exc)
    assert_group_gone(pids[victim])  # the failure is handled to its end: its group is reaped
    assert healthy(engine) == [1 - victim], engine.replicas
    assert engine.step({"op": "pid"}, timeout=30)["replica"] == 1 - victim  # and the other one serves


# --------------------------------------------------------------------------- heartbeats and deadlines


def test_sigstop_is_caught_by_heartbeats(tmp_path):
    # a short heartbeat timeout, with room for a loaded 2-core machine
    engine = start_engine(parallel=tp_parallel(2), heartbeat_interval_s=0.25, heartbeat_timeout_s=2.5)
    pids = [row[0] for row in engine.step({"op": "pid"}, timeout=30)["pids"]]
    mark = str(tmp_path / "running")
    try:
        future = engine.submit({"op": "sleep", "s": 30.0, "mark": mark})
        assert wait_until(lambda: len(mark_files(mark)) == 2, 30), mark_files(mark)  # inside the plugin
        stopped_at = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        exc = failure_of(future, 15)
        elapsed = time.monotonic() - stopped_at
        assert "rank 1" in str(exc) and "no heartbeat" in str(exc), str(exc)
        # caught by the heartbeat deadline: not before it, and not much after it
        assert 2.0 < elapsed < 5.0, elapsed
        assert not engine.replicas[0].healthy and "no heartbeat" in engine.replicas[0].error
        with pytest.raises(EngineUnavailableError, match="no healthy replica"):
            engine.submit({"op": "pid"})
        assert_group_gone(pids)  # SIGKILL ends a stopped process too
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        close_engine(engine)


def test_startup_is_bounded_by_startup_timeout_not_by_heartbeats():
    engine = start_engine(plugin_args={"hold_gil_s": 3.0}, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0,
                          startup_timeout_s=60.0)
    try:
        assert engine.step({"op": "echo", "x": 1}, timeout=30) == 1
    finally:
        close_engine(engine)


def test_execution_timeout_counts_queued_time():
    """Two 1 s requests on one single-rank replica with execution_timeout_s=1.5.

    The first finishes at ~1.0 s, inside its deadline. The second starts at ~1.0 s
    and would finish at ~2.0 s: it runs only 1.0 s, but its deadline is 1.5 s after
    its submission, so it fails at ~1.5 s while running. Counted from its start it
    would have had until ~2.5 s and succeeded.
    """
    engine = start_engine(execution_timeout_s=1.5)
    try:
        assert engine.mode == "local" and engine.ranks_per_replica == 1
        pid = engine.step({"op": "pid"}, timeout=30)["pids"][0][0]
        submitted = time.monotonic()
        first = engine.submit({"op": "sleep", "s": 1.0})
        second = engine.submit({"op": "sleep", "s": 1.0})
        assert first.result(10)["pid"] == pid
        exc = failure_of(second, 10)
        elapsed = time.monotonic() - submitted
        assert "execution timeout 1.5 s after submission" in str(exc), str(exc)
        assert 1.4 < elapsed < 1.95, elapsed
        assert not engine.replicas[0].healthy
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="no healthy replica"):
            engine.submit({"op": "pid"})
        assert time.monotonic() - started < 0.5  # fails at once, nothing is waited for
        assert_group_gone([pid])
    finally:
        close_engine(engine)


# --------------------------------------------------------------------------- start


def test_a_plugin_that_raises_in_build_fails_the_start_and_leaves_nothing():
    before = child_pids()
    runs = len(conftest.RUNS)
    started = time.monotonic()
    with pytest.raises(WorkerStartupError) as info:
        start_engine(parallel=tp_parallel(2), plugin_args={"fail_build_rank": 1}, startup_timeout_s=60.0)
    assert time.monotonic() - started < 30  # failed fast, not at startup_timeout_s
    exc = info.value
    assert "rank 1" in str(exc), str(exc)
    assert "KeyError" in str(exc) and "build failed on purpose on rank 1" in str(exc), str(exc)
    cause = exc.__cause__
    assert isinstance(cause, RemoteError), repr(cause)
    assert cause.remote_type == "KeyError"
    assert "in build" in cause.remote_traceback and "raise KeyError" in cause.remote_traceback
    assert "--- remote traceback ---" in str(cause)
    # no process is left once the constructor has raised, nor its run directory or segments
    assert wait_until(lambda: child_pids() <= before, 1.0), child_pids() - before
    [run_id] = conftest.RUNS[runs:]
    assert leftovers(run_id) == []

