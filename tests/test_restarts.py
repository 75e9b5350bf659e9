"""Replica restarts (``DeploymentConfig.replica_restarts``, ``runtime.execution.restarts``).

The controller's rules (backoff, budget, which supervisor is closed, close during a
rebuild) are checked first on stand-in supervisors, without processes. Then real local
engines of one-rank replicas: a replica whose rank is SIGKILLed is rebuilt while the other
serves, is given up once its budget is spent, ``can_serve`` follows; close during a rebuild
leaves nothing; without restarts a failed replica stays down. ``tests/conftest.py``'s
``no_leaks`` checks after each test that no rank, run directory or segment is left.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import psutil
import pytest

from runtime import DeploymentConfig, Engine, EngineUnavailableError, WorkerStartupError, WorkerSupervisorConfig
from runtime.execution.dispatcher import RequestDispatcher
from runtime.execution.multiprocess import MultiprocessExecutor
from runtime.execution.restarts import MAX_BACKOFF_S, RestartController, backoff_s
from tests.conftest import engine_args, leftovers, pid_alive, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]


# --------------------------------------------------------------------------- stand-ins


class StandInSupervisor:
    """The part of a WorkerSupervisor an executor uses: groups that fail when told to."""

    def __init__(self, groups: int = 1) -> None:
        self.failed: list[str | None] = [None] * groups
        self.closed = threading.Event()
        self.listeners: dict[int, list] = {}

    def replica(self, group: int) -> "StandInReplica":
        return StandInReplica(self, group)

    def on_group_failure(self, group: int, callback) -> bool:
        if self.failed[group] is not None:  # told already: too late
            return False
        self.listeners.setdefault(group, []).append(callback)
        return True

    def fail(self, group: int, reason: str) -> None:
        """As a group failing does: the flag, then (on a thread of its own) its listeners."""
        self.failed[group] = reason
        for callback in self.listeners.pop(group, []):
            threading.Thread(target=callback).start()

    def close(self) -> None:
        self.failed = [f or "the engine is closed" for f in self.failed]
        self.closed.set()


class StandInReplica:
    """The part of a Replica an executor reads: its group's word, no info, no queue."""

    info = None

    def __init__(self, supervisor: StandInSupervisor, group: int) -> None:
        self._supervisor, self._group = supervisor, group

    @property
    def failed(self) -> str | None:
        return self._supervisor.failed[self._group]

    def queue_stats(self) -> dict | None:
        return None

    def submit(self, request, future: Future, stream=None, priority=0) -> None:
        future.set_result((id(self._supervisor), self._group, request))


def stand_in_engine(replicas: int, start, max_restarts: int, backoff: float):
    shared = StandInSupervisor(replicas)
    dispatcher = RequestDispatcher([MultiprocessExecutor(shared, i, (i,)) for i in range(replicas)])
    return shared, dispatcher, RestartController(dispatcher, start, max_restarts, backoff, startup_timeout_s=5.0)


def close_stand_in(dispatcher: RequestDispatcher, controller: RestartController) -> None:
    controller.stop()
    dispatcher.close()
    controller.join()


def test_restart_settings_are_checked_and_default_to_fail_fast():
    assert (DeploymentConfig().replica_restarts, DeploymentConfig().restart_backoff_s) == (0, 1.0)
    local = DeploymentConfig.local(devices=(0, 1), replica_count=2, replica_restarts=3, restart_backoff_s=0.5)
    assert (local.replica_restarts, local.restart_backoff_s) == (3, 0.5)
    with pytest.raises(ValueError, match=r"DeploymentConfig.replica_restarts must be >= 0, got -1"):
        DeploymentConfig(replica_restarts=-1)
    with pytest.raises(TypeError, match=r"DeploymentConfig.replica_restarts must be an int"):
        DeploymentConfig(replica_restarts=1.5)
    with pytest.raises(ValueError, match=r"DeploymentConfig.restart_backoff_s must be .* > 0, got 0"):
        DeploymentConfig(restart_backoff_s=0)


def test_backoff_doubles_from_the_base_and_stops_at_60_s():
    assert [backoff_s(0.5, k) for k in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_s(1.0, 7) == MAX_BACKOFF_S == 60.0
    assert backoff_s(1.0, 50) == 60.0


def test_failed_starts_count_their_waits_double_and_the_replica_is_given_up(caplog):
    starts: list[float] = []

    def start(index: int, cancel=None):
        starts.append(time.monotonic())
        raise WorkerStartupError(f"replica {index}: no device today")

    shared, dispatcher, controller = stand_in_engine(2, start, max_restarts=3, backoff=0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="phyrt.engine"):
            failed_at = time.monotonic()
            shared.fail(0, "rank 0 exited with SIGKILL")
            status = controller.statuses()[0]  # seen at once, not only by the next poll
            assert (status.healthy, status.restarting, status.restarts) == (False, True, 1)
            assert "SIGKILL" in status.error
            # a replica being rebuilt is never chosen: every request goes to replica 1
            assert {dispatcher.submit({"n": n}).result(1)[1] for n in range(4)} == {1}
            assert wait_until(lambda: not controller.statuses()[0].restarting, 10)
        status = controller.statuses()[0]
        assert (status.healthy, status.restarting, status.restarts) == (False, False, 3)
        assert "rebuild 3 failed to start" in status.error and "no device today" in status.error
        assert len(starts) == 3
        waits = [b - a for a, b in zip([failed_at] + starts, starts)]
        assert waits[0] >= 0.05 and waits[1] >= 0.1 and waits[2] >= 0.2, waits
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert [w.split(" in ")[1].split(" s ")[0] for w in warnings if "rebuilding it" in w] == \
            ["0.05", "0.1", "0.2"], warnings
        assert "no device today" in warnings[-1]
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "replica 0 is given up" in errors[0], errors
        time.sleep(0.2)
        assert len(starts) == 3  # given up for good
        assert not shared.closed.is_set()  # replica 1 still serves through it
        assert controller.statuses()[1].healthy
    finally:
        close_stand_in(dispatcher, controller)


def test_a_rebuilt_replica_is_swapped_in_and_an_unused_supervisor_closed():
    built: list[StandInSupervisor] = []

    def start(index: int, cancel=None):
        built.append(StandInSupervisor(1))
        return MultiprocessExecutor(built[-1], index, (index,), group=0)

    shared, dispatcher, controller = stand_in_engine(2, start, max_restarts=1, backoff=0.01)
    try:
        shared.fail(0, "rank 0 missed its heartbeats")
        assert wait_until(lambda: controller.statuses()[0].healthy, 5)
        assert controller.statuses()[0].restarts == 1 and controller.statuses()[0].error is None
        assert not shared.closed.is_set()  # still replica 1's
        answers = {dispatcher.submit({"n": n}).result(1)[:2] for n in range(4)}
        assert answers == {(id(built[0]), 0), (id(shared), 1)}  # both replicas serve

        shared.fail(1, "rank 0 exited with code 3")
        assert wait_until(lambda: controller.statuses()[1].healthy, 5)
        assert shared.closed.wait(5)  # no replica uses it any more

        built[0].fail(0, "rank 0 exited with SIGKILL")  # replica 0's budget is spent
        assert wait_until(lambda: not controller.statuses()[0].restarting
                          and not controller.statuses()[0].healthy, 5)
        assert built[0].closed.wait(5)  # its own supervisor goes at once
        assert len(built) == 2 and controller.statuses()[0].restarts == 1
    finally:
        close_stand_in(dispatcher, controller)


def test_close_cuts_a_backoff_short_and_closes_a_start_that_ends_after_it():
    release = threading.Event()
    started = threading.Event()
    late: list[StandInSupervisor] = []

    def slow_start(index: int, cancel=None):
        started.set()
        release.wait(10)
        late.append(StandInSupervisor(1))
        return MultiprocessExecutor(late[-1], index, (index,), group=0)

    shared, dispatcher, controller = stand_in_engine(1, slow_start, max_restarts=2, backoff=30.0)
    shared.fail(0, "rank 0 exited with SIGKILL")
    assert controller.statuses()[0].restarting
    began = time.monotonic()
    close_stand_in(dispatcher, controller)
    assert time.monotonic() - began < 2.0 and not started.is_set()  # the 30 s wait was cut short

    shared, dispatcher, controller = stand_in_engine(1, slow_start, max_restarts=2, backoff=0.01)
    shared.fail(0, "rank 0 exited with SIGKILL")
    assert started.wait(5)
    closer = threading.Thread(target=close_stand_in, args=(dispatcher, controller))
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive()  # close waits for the start under way ...
    release.set()
    closer.join(5)
    assert not closer.is_alive() and late[0].closed.is_set()  # ... then closes it at once
    assert dispatcher.executors[0].supervisor is shared  # it never served


def test_a_replica_that_failed_before_the_controller_listened_is_rebuilt_before_it_returns():
    built: list[StandInSupervisor] = []

    def start(index: int, cancel=None):
        built.append(StandInSupervisor(1))
        return MultiprocessExecutor(built[-1], index, (index,), group=0)

    shared = StandInSupervisor(1)
    dispatcher = RequestDispatcher([MultiprocessExecutor(shared, 0, (0,))])
    shared.fail(0, "rank 0 exited right after its start")  # its failure was told to nobody
    controller = RestartController(dispatcher, start, 1, 0.01, startup_timeout_s=5.0)
    try:
        status = controller.statuses()[0]  # handled by the constructor's thread: no callback would come
        assert (status.healthy, status.restarts, len(built)) == (True, 1, 1)
        assert shared.closed.is_set()  # its supervisor served no other replica
    finally:
        close_stand_in(dispatcher, controller)


def test_a_replacement_dead_on_arrival_is_rebuilt_again_by_the_same_thread():
    built: list[StandInSupervisor] = []

    def start(index: int, cancel=None):
        built.append(StandInSupervisor(1))
        if len(built) == 1:  # failed before it could be listened to: its callback never comes
            built[0].failed[0] = "rank 0 exited during the swap"
        return MultiprocessExecutor(built[-1], index, (index,), group=0)

    shared, dispatcher, controller = stand_in_engine(1, start, max_restarts=2, backoff=0.01)
    try:
        shared.fail(0, "rank 0 exited with SIGKILL")
        assert wait_until(lambda: controller.statuses()[0].healthy, 5)
        assert (controller.statuses()[0].restarts, len(built)) == (2, 2)
        assert built[0].closed.wait(5) and not built[1].closed.is_set()
        assert dispatcher.executors[0].supervisor is built[1]
    finally:
        close_stand_in(dispatcher, controller)


# --------------------------------------------------------------------------- real engines


def local_engine(replicas: int, restarts: int, backoff: float = 0.2) -> Engine:
    """One-rank replicas of ``tests.plugins:TPProbe`` on CPU."""
    deployment = DeploymentConfig.local(devices=tuple(range(replicas)), replica_count=replicas,
                                        process_config=WorkerSupervisorConfig(heartbeat_timeout_s=10.0),
                                        replica_restarts=restarts, restart_backoff_s=backoff)
    return Engine(engine_args(), deployment)


def pids_serving(engine: Engine, tries: int = 6) -> set[int]:
    """The rank pids that answered ``tries`` requests in a row (ties rotate between replicas)."""
    return {engine.step({"op": "pid"}, timeout=30)["pids"][0][0] for _ in range(tries)}


def kill_and_wait_down(engine: Engine, index: int, pid: int) -> float:
    psutil.Process(pid).kill()
    killed = time.monotonic()
    assert wait_until(lambda: not engine.replicas[index].healthy, 5)
    return killed


def serve_until_back(engine: Engine, index: int, survivor_pid: int, timeout: float) -> bool:
    """Requests while ``index`` is rebuilt: each one succeeds, on the survivor."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.replicas[index].healthy:
            return True
        assert engine.step({"op": "pid"}, timeout=30)["pids"][0][0] == survivor_pid
        time.sleep(0.02)
    return False


@pytest.mark.timeout(240)
def test_a_killed_replica_is_rebuilt_while_the_other_serves_until_its_budget_is_spent(caplog, record_runs):
    caplog.set_level(logging.WARNING, logger="phyrt.engine")
    engine = local_engine(2, restarts=1)
    try:
        first_run = record_runs[-1]
        by_replica = {}
        for _ in range(6):
            answer = engine.step({"op": "pid"}, timeout=30)
            by_replica[answer["replica"]] = answer["pids"][0][0]
        r0_pid, r1_pid = by_replica[0], by_replica[1]

        killed = kill_and_wait_down(engine, 0, r0_pid)
        status = engine.replicas[0]
        assert (status.restarting, status.restarts) == (True, 1) and "SIGKILL" in status.error
        assert engine.can_serve
        assert serve_until_back(engine, 0, r1_pid, 60)
        print(f"\nreplica 0 serves again {time.monotonic() - killed:.2f} s after its rank was SIGKILLed")
        status = engine.replicas[0]
        assert (status.healthy, status.restarting, status.restarts, status.error) == (True, False, 1, None)
        both = pids_serving(engine)
        assert len(both) == 2 and r1_pid in both and r0_pid not in both  # requests reach both again
        new0 = (both - {r1_pid}).pop()
        assert leftovers(first_run) != []  # the shared supervisor still holds replica 1

        kill_and_wait_down(engine, 0, new0)  # its one rebuild is spent: given up
        status = engine.replicas[0]
        assert (status.healthy, status.restarting, status.restarts) == (False, False, 1) and "SIGKILL" in status.error
        assert any("replica 0 is given up" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        runs = len(record_runs)

        kill_and_wait_down(engine, 1, r1_pid)  # replica 1 has a rebuild of its own
        assert engine.replicas[1].restarting and engine.can_serve
        with pytest.raises(EngineUnavailableError):  # nothing serves meanwhile, and says so at once
            engine.step({"op": "pid"}, timeout=30)
        assert wait_until(lambda: engine.replicas[1].healthy, 60)
        assert len(record_runs) == runs + 1  # replica 1's rebuild only
        assert wait_until(lambda: leftovers(first_run) == [], 10)  # no replica uses the first supervisor
        answer = engine.step({"op": "pid"}, timeout=30)
        new1 = answer["pids"][0][0]
        # the rebuilt replica's rank knows which replica it is, and says so in ps
        assert answer["replica"] == 1 and psutil.Process(new1).name() == "phyrt-r1-0"

        kill_and_wait_down(engine, 1, new1)
        assert wait_until(lambda: not engine.can_serve, 5)
        assert not any(s.restarting for s in engine.replicas)
        with pytest.raises(EngineUnavailableError, match="no healthy replica"):
            engine.step({"op": "pid"}, timeout=30)
        assert len(record_runs) == runs + 1
    finally:
        engine.close()
    assert not engine.can_serve


@pytest.mark.timeout(120)
def test_close_during_a_rebuild_leaves_no_process_run_directory_or_segment(record_runs):
    engine = local_engine(1, restarts=2, backoff=0.05)
    try:
        runs = len(record_runs)
        pid = engine.step({"op": "pid"}, timeout=30)["pids"][0][0]
        kill_and_wait_down(engine, 0, pid)
        assert wait_until(lambda: len(record_runs) > runs, 10)  # the rebuild's supervisor is starting
    finally:
        began = time.monotonic()
        engine.close()
        took = time.monotonic() - began
    print(f"\nclose during a rebuild's start took {took:.2f} s")
    assert not pid_alive(pid)
    assert all(leftovers(run) == [] for run in record_runs[runs - 1:])
    # no_leaks: no rank of the rebuild either


@pytest.mark.timeout(60)
def test_without_restarts_a_failed_replica_stays_down(record_runs):
    engine = local_engine(1, restarts=0)
    try:
        runs = len(record_runs)
        pid = engine.step({"op": "pid"}, timeout=30)["pids"][0][0]
        kill_and_wait_down(engine, 0, pid)
        time.sleep(0.5)
        status = engine.replicas[0]
        assert (status.restarting, status.restarts) == (False, 0) and "SIGKILL" in status.error
        assert not engine.can_serve
        with pytest.raises(EngineUnavailableError, match="SIGKILL"):
            engine.step({"op": "pid"}, timeout=30)
        assert len(record_runs) == runs  # no new supervisor
    finally:
        engine.close()
