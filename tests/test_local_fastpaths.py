"""The short paths of a local replica's round trip, each next to the behaviour it keeps.

- A one-rank group's submit sends without the POLLOUT check (its NOBLOCK send goes
  out whole or not at all): a submit racing that rank's death neither blocks nor is
  lost, while the supervisor's I/O thread is stalled (as in the kill matrix's race).
- The I/O thread completes futures at the end of its loop iteration, after taking the
  answer, and gives the request arena's blocks back right after: every answer arrives,
  tensors through shared memory or inline, from concurrent callers, and every block
  goes back.
- ``EngineCore.run``, the rank's one-call path for an executing runner, is ``add``
  then ``step``; ``runtime.futures.resolve`` completes once and never raises.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from runtime import EngineUnavailableError
from tests.conftest import close_engine, group_pids, pid_alive, start_engine, supervisor_of, wait_until

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def _module_end(no_leaks_at_module_end):
    yield


def submit_to(engine: Any, replica: int, request: dict) -> Future:
    return engine._dispatcher.executors[replica].submit(request)


def arena_blocks_in_use(engine: Any) -> int:
    return sum(len(seg.used) for g in supervisor_of(engine)._groups for seg in g.arena._segments.values())


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
    busy = sup._groups[witness].arena_lock
    outcome: dict[str, Any] = {}

    def submit() -> None:
        try:
            outcome["future"] = submit_to(engine, victim, {"op": "pid"})
        except EngineUnavailableError as exc:  # refused at once: as good as a failed future
            outcome["refused"] = exc

    try:
        with busy:  # once the witness's answer is completed, the I/O thread waits for this lock
            assert submit_to(engine, witness, {"op": "sleep", "s": 0.2}).result(30)["replica"] == witness
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: not pid_alive(pid), 10)
            time.sleep(0.5)  # libzmq has dropped the dead rank's inbox connection
            assert engine.replicas[victim].healthy  # the stalled I/O thread has not seen the death
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
    from runtime.config import EngineConfig
    from runtime.plugins import Entry
    from workers.core import EngineCore, make_context

    class Runner:
        def execute(self, request: Any) -> Any:
            if request == "boom":
                raise ZeroDivisionError("boom")
            return 2 * request

    class Doubler(Entry):
        def build(self, ctx: Any, plugin_args: Any) -> Any:
            return Runner()

    core = EngineCore(Doubler(), None, make_context(EngineConfig()))
    assert not core.batching
    assert core.run(7, 21) == [(7, 42, None)]
    core.add(8, 21)
    assert core.step() == [(8, 42, None)] and not core.has_unfinished()
    [(request_id, result, error)] = core.run(9, "boom")
    assert (request_id, result, type(error), str(error)) == (9, None, ZeroDivisionError, "boom")


def test_resolve_completes_once_and_never_raises():
    from runtime.futures import resolve

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
