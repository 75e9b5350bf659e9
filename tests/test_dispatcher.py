"""RequestDispatcher with fake executors: no processes, no threads of ours."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from runtime.execution.dispatcher import RequestDispatcher
from runtime.core.errors import EngineUnavailableError
from runtime.execution.executor import ReplicaExecutor

pytestmark = pytest.mark.timeout(30)


class FakeExecutor(ReplicaExecutor):
    """Keeps every future pending until the test completes it."""

    mode = "fake"

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.received: list = []
        self.futures: list[Future] = []
        self.closed = False
        self.fail_on_submit = False

    def _submit(self, request, future, stream=None, priority=0):
        if self.fail_on_submit:
            self.mark_failed("died between the health check and the send")
            raise EngineUnavailableError("replica gone")
        self.received.append(request)
        self.futures.append(future)

    def close(self, timeout=None):
        self.closed = True


def make(n):
    executors = [FakeExecutor(i) for i in range(n)]
    return executors, RequestDispatcher(executors)


def test_ties_rotate_round_robin():
    executors, dispatcher = make(3)
    for i in range(6):
        future = dispatcher.submit(i)
        future.set_result(None)  # nothing stays in flight: every choice is a tie
    assert [e.received for e in executors] == [[0, 3], [1, 4], [2, 5]]


def test_least_in_flight_wins():
    executors, dispatcher = make(3)
    for i in range(3):
        dispatcher.submit(i)  # one in flight each
    executors[1].futures[0].set_result(None)  # replica 1 is now the least loaded
    dispatcher.submit("next")
    assert executors[1].received[-1] == "next"
    assert [e.inflight for e in executors] == [1, 1, 1]


def test_inflight_counts_follow_futures():
    executors, dispatcher = make(2)
    futures = [dispatcher.submit(i) for i in range(4)]
    assert [e.inflight for e in executors] == [2, 2]
    for f in futures:
        f.set_exception(RuntimeError("x"))
    assert [e.inflight for e in executors] == [0, 0]


def test_unhealthy_replica_leaves_rotation_for_good():
    executors, dispatcher = make(2)
    executors[0].mark_failed("rank 1 exited with signal 9")
    for i in range(4):
        dispatcher.submit(i).set_result(None)
    assert executors[0].received == []
    assert executors[1].received == [0, 1, 2, 3]
    assert not executors[0].mark_failed("again")  # health never comes back
    statuses = dispatcher.statuses()
    assert [s.healthy for s in statuses] == [False, True]
    assert statuses[0].error == "rank 1 exited with signal 9"


def test_none_healthy_fails_at_once_naming_causes():
    executors, dispatcher = make(2)
    executors[0].mark_failed("no heartbeat for 2.0 s")
    executors[1].mark_failed("rank 0 exited with code 1")
    with pytest.raises(EngineUnavailableError, match="no heartbeat for 2.0 s.*exited with code 1"):
        dispatcher.submit("x")


def test_replica_failing_during_submit_falls_over_to_the_next():
    executors, dispatcher = make(2)
    executors[0].fail_on_submit = True
    future = dispatcher.submit("x")
    assert executors[1].received == ["x"]
    assert not future.done()
    assert not executors[0].healthy
    assert executors[0].inflight == 0


def test_close_closes_every_executor_and_refuses_work():
    executors, dispatcher = make(2)
    dispatcher.close()
    dispatcher.close()  # idempotent
    assert all(e.closed for e in executors)
    with pytest.raises(EngineUnavailableError, match="closed"):
        dispatcher.submit("x")


def test_needs_an_executor():
    with pytest.raises(ValueError):
        RequestDispatcher([])


class SlowSend(FakeExecutor):
    """Its send blocks until the test lets it go (as a large tensor's copy into shared memory)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        import threading

        self.sending, self.go = threading.Event(), threading.Event()

    def _submit(self, request, future, stream=None, priority=0):
        self.sending.set()
        assert self.go.wait(10)
        super()._submit(request, future)


@pytest.mark.parametrize("way", ["submit", "step"])
def test_the_lock_covers_the_choice_not_the_send(way):
    """A request being encoded and sent to one replica does not hold back the next one, which
    goes to the other replica (it sees the first's in-flight count)."""
    import threading

    slow, fast = SlowSend(0), FakeExecutor(1)
    dispatcher = RequestDispatcher([slow, fast])
    first = threading.Thread(target=(lambda: dispatcher.submit("big")) if way == "submit"
                             else (lambda: dispatcher.call("big", 10)))
    first.start()
    try:
        assert slow.sending.wait(5)
        second = dispatcher.submit("small")  # returns while the first is still in its send
        assert fast.received == ["small"] and not second.done() and slow.inflight == 1
    finally:
        slow.go.set()
        if way == "step":
            assert slow.sending.is_set()
            import time

            deadline = time.monotonic() + 5
            while not slow.futures and time.monotonic() < deadline:
                time.sleep(0.01)
            slow.futures[0].set_result("done")
        first.join(5)
    assert not first.is_alive() and slow.received == ["big"]
