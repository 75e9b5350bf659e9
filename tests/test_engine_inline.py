"""The inline engine: the plugin runs on one background thread of this process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

from runtime import (DenseParallelConfig, DeploymentConfig, Engine, EngineArgs, EngineConfig,
                     EngineUnavailableError, ParallelConfig)
from tests import plugins
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
ECHO = "tests.plugins:Echo"


@pytest.fixture
def engine():
    plugins.gate.set()
    plugins.log.clear()
    with Engine(EngineArgs(ECHO)) as eng:
        yield eng
    plugins.gate.set()


def test_single_rank_defaults_to_inline(engine):
    assert engine.mode == "inline"
    assert engine.step({"x": 1}) == {"x": 1}
    [status] = engine.replicas
    assert status.healthy and status.inflight == 0 and status.mode == "inline"


def test_submit_returns_at_once_and_runs_fifo(engine):
    plugins.gate.clear()
    first = engine.submit({"wait_gate": True, "n": 0})
    rest = [engine.submit({"n": i}) for i in range(1, 5)]
    assert not first.done()
    assert engine.replicas[0].inflight == 5
    plugins.gate.set()
    assert [f.result(10)["n"] for f in [first] + rest] == [0, 1, 2, 3, 4]
    assert [r["n"] for r in plugins.log] == [0, 1, 2, 3, 4]


def test_queued_request_can_be_cancelled_running_cannot(engine):
    plugins.gate.clear()
    running = engine.submit({"wait_gate": True})
    queued = engine.submit({"n": 1})
    deadline = time.monotonic() + 5
    while not running.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running.running()
    assert not running.cancel()
    assert queued.cancel()
    plugins.gate.set()
    assert running.result(10) == {"wait_gate": True}
    with pytest.raises(CancelledError):
        queued.result(1)
    assert engine.step({"n": 2}) == {"n": 2}
    assert {"n": 1} not in plugins.log  # the cancelled request never ran


def test_plugin_exception_keeps_its_type_and_replica_stays_healthy(engine):
    with pytest.raises(ZeroDivisionError, match="on purpose"):
        engine.step({"raise": "ZeroDivisionError", "message": "on purpose"})
    assert engine.replicas[0].healthy
    assert engine.step({"after": True}) == {"after": True}


def test_validate_request_runs_in_the_caller(engine):
    with pytest.raises(ValueError, match="marked invalid"):
        engine.submit({"invalid": True})
    assert plugins.log == []  # nothing was queued


def test_step_timeout_cancels_a_queued_request(engine):
    plugins.gate.clear()
    engine.submit({"wait_gate": True})
    with pytest.raises(TimeoutError, match="cancelled while queued"):
        engine.step({"n": 9}, timeout=0.2)
    plugins.gate.set()
    assert engine.step({"n": 10}) == {"n": 10}
    assert {"n": 9} not in plugins.log


def test_close_cancels_queued_work_and_refuses_new_work():
    plugins.gate.clear()
    eng = Engine(EngineArgs(ECHO))
    running = eng.submit({"wait_gate": True})
    queued = [eng.submit({"n": i}) for i in range(3)]
    while not running.running():
        time.sleep(0.01)
    closer = __import__("threading").Thread(target=eng.close)
    closer.start()
    time.sleep(0.1)
    plugins.gate.set()  # the running request is allowed to finish
    closer.join(10)
    assert running.result(1) == {"wait_gate": True}
    assert all(f.cancelled() for f in queued)
    eng.close()  # idempotent
    assert eng.closed
    with pytest.raises(EngineUnavailableError, match="closed"):
        eng.submit({"n": 1})
    with pytest.raises(EngineUnavailableError, match="closed"):
        eng.step({"n": 1})


def test_close_timeout_fails_a_stuck_request():
    plugins.gate.clear()
    eng = Engine(EngineArgs(ECHO))
    stuck = eng.submit({"wait_gate": True})
    while not stuck.running():
        time.sleep(0.01)
    started = time.monotonic()
    eng.close(timeout=0.3)
    assert time.monotonic() - started < 5
    with pytest.raises(EngineUnavailableError, match="still running"):
        stuck.result(1)
    plugins.gate.set()


def test_base_exception_in_plugin_takes_replica_down():
    with Engine(EngineArgs(ECHO)) as eng:
        with pytest.raises(EngineUnavailableError, match="SystemExit"):
            eng.step({"raise": "SystemExit"})
        assert not eng.replicas[0].healthy
        with pytest.raises(EngineUnavailableError, match="no healthy replica"):
            eng.submit({"n": 1})


def test_build_failure_raises_from_the_constructor():
    with pytest.raises(RuntimeError, match="build failed on purpose"):
        Engine(EngineArgs(ECHO, plugin_args={"fail_build": True}))


def test_topology_checked_before_anything_is_built():
    plugins.log.clear()
    args = EngineArgs(ECHO, plugin_args={"fail_build": True},
                      config=EngineConfig(parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    with pytest.raises(ValueError, match="dense.tp_size=2"):
        Engine(args, DeploymentConfig.local(devices=(0, 1)))


def test_unknown_plugin_lists_known_ones():
    with pytest.raises(ValueError, match="policy"):
        Engine(EngineArgs("no-such-plugin"))


def test_stepped_runner_batches_concurrent_requests():
    plugins.gate.clear()
    with Engine(EngineArgs("tests.plugins:Batching")) as eng:
        first = eng.submit(3)
        time.sleep(0.1)  # first is inside step(), blocked on the gate
        more = [eng.submit(2) for _ in range(3)]
        plugins.gate.set()
        results = [f.result(10) for f in [first] + more]
    # after the first step, the three later requests join the running one
    assert max(max(r["batches_seen"]) for r in results) == 4
    with pytest.raises(ValueError, match="positive int"):
        with Engine(EngineArgs("tests.plugins:Batching")) as eng:
            eng.step(0)


def test_unclosed_engine_does_not_keep_the_interpreter_alive():
    code = textwrap.dedent("""
        from runtime import Engine, EngineArgs
        eng = Engine(EngineArgs("tests.plugins:Echo"))
        assert eng.step({"n": 1}) == {"n": 1}
        eng.submit({"sleep": 0.5})
        print("leaving", flush=True)
    """)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "leaving" in out.stdout
    assert time.monotonic() - started < 25


def test_the_inline_runner_runs_in_the_calling_thread_only_when_nothing_else_is_held(engine):
    import threading

    runner = engine.inline_runner()
    calls = []
    ran, result, error = runner.run({"x": 1}, lambda: calls.append(threading.get_ident()))
    assert (ran, result, error) == (True, {"x": 1}, None) and calls == [threading.get_ident()]
    ran, result, error = runner.run({"raise": "ZeroDivisionError"}, lambda: None)
    assert ran and result is None and isinstance(error, ZeroDivisionError)
    assert engine.replicas[0].healthy  # a plugin exception fails that request only, as submitted ones do
    with pytest.raises(ValueError, match="marked invalid"):
        runner.run({"invalid": True}, lambda: None)
    # the engine holds a request (running on its thread): nothing runs here, nothing is called
    plugins.gate.clear()
    held = engine.submit({"wait_gate": True})
    time.sleep(0.1)
    plugins.log.clear()
    assert runner.run({"y": 2}, lambda: calls.append("no")) == (False, None, None)
    assert plugins.log == [] and calls == [threading.get_ident()]
    plugins.gate.set()
    assert held.result(10) == {"wait_gate": True}
    assert engine.replicas[0].inflight == 0
    engine.close()
    assert runner.run({"z": 3}, lambda: None) == (False, None, None)


def test_a_request_waiting_behind_one_the_inline_runner_runs_can_still_be_cancelled(engine):
    """The serve thread marks a request running only once it holds the runner: one queued
    while another thread runs a request (``inline_runner()``) stays cancellable (a server's
    deadline cancels it) and never reaches the plugin."""
    import threading

    plugins.gate.clear()
    try:
        here = threading.Thread(target=engine.inline_runner().run, args=({"wait_gate": True}, lambda: None),
                                daemon=True)
        here.start()
        assert wait_until(lambda: engine.replicas[0].inflight == 1, 5)
        plugins.log.clear()
        queued = engine.submit({"queued": 1})
        time.sleep(0.2)  # the serve thread has taken it from the queue and waits for the runner
        assert queued.cancel(), "a request not yet running could not be cancelled"
        later = engine.submit({"later": 1})
    finally:
        plugins.gate.set()
    here.join(10)
    assert later.result(10) == {"later": 1}
    assert {"queued": 1} not in plugins.log
    assert wait_until(lambda: engine.replicas[0].inflight == 0, 5)
