"""Dynamic batching (``BatchingConfig``, ``execute_batch``) and priority lanes, inline and local."""

from __future__ import annotations

import time

import pytest
import torch

from runtime import (BatchingConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs,
                     EngineConfig, EngineUnavailableError, ParallelConfig, WorkerStartupError,
                     WorkerSupervisorConfig)
from tests import batch_plugins as bp

pytestmark = pytest.mark.timeout(120)
CPU = DeviceConfig(target="cpu")


def x(i: int, **fields) -> dict:
    return {"x": torch.tensor([i]), **fields}


def config(size: int = 1, delay_ms: float = 0.0, tp: int = 1) -> EngineConfig:
    return EngineConfig(device=CPU, batching=BatchingConfig(size, delay_ms),
                        parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=tp)))


def inline(plugin: str = "BatchEcho", size: int = 4, delay_ms: float = 50.0) -> Engine:
    return Engine(EngineArgs(plugin=f"tests.batch_plugins:{plugin}", config=config(size, delay_ms)))


@pytest.fixture
def held():
    """The inline runner held inside its current request until the test lets go."""
    bp.batches.clear()
    bp.gate.clear()
    try:
        yield bp.gate
    finally:
        bp.gate.set()


def occupy(engine: Engine, plugin_log: list) -> object:
    """A request the runner holds (the gate), so that the next ones queue."""
    first = engine.submit(x(-1, wait_gate=True), priority=100)
    deadline = time.monotonic() + 10
    while not plugin_log and time.monotonic() < deadline:
        time.sleep(0.005)
    return first


# -- the config -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4", 70000])
def test_a_bad_batch_size_is_refused(bad):
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchingConfig(max_batch_size=bad)


@pytest.mark.parametrize("bad", [-1, float("nan"), True, "2", 1e9])
def test_a_bad_delay_is_refused(bad):
    with pytest.raises(ValueError, match="max_delay_ms"):
        BatchingConfig(max_batch_size=2, max_delay_ms=bad)


def test_batching_needs_execute_batch_at_start():
    with pytest.raises(TypeError, match="execute_batch.*SlowEchoRunner.*has none"):
        inline("SlowEcho")
    with pytest.raises(TypeError, match="stepped runner"):
        Engine(EngineArgs(plugin="tests.plugins:Batching", config=config(4, 1.0)))


# -- inline -----------------------------------------------------------------------------------


def test_batches_are_formed_and_each_result_reaches_its_own_future(held):
    with inline(size=4) as engine:
        first = occupy(engine, bp.batches)
        futures = {i: engine.submit(x(i)) for i in range(10)}
        held.set()
        assert first.result(10)["x"] == -1
        for i, future in futures.items():
            result = future.result(10)
            assert result["x"] == i and i in result["batch"]
        assert bp.batches[1:] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # FIFO within a level
        queue = engine.replicas[0].queue
        assert queue["batches"] == 4 and queue["batched"] == 11 and queue["levels"]["0"]["count"] == 10


def test_requests_whose_shapes_differ_go_in_separate_batches(held):
    with inline(size=8) as engine:
        occupy(engine, bp.batches)
        narrow = [engine.submit(x(i, obs=torch.zeros(1, 3))) for i in range(3)]
        wide = [engine.submit(x(10 + i, obs=torch.zeros(2, 4))) for i in range(2)]
        tall = engine.submit(x(20, obs=torch.zeros(5, 3)))  # only the leading dimension differs
        held.set()
        assert [f.result(10)["x"] for f in narrow + wide + [tall]] == [0, 1, 2, 10, 11, 20]
        assert sorted(bp.batches[1:]) == [[0, 1, 2, 20], [10, 11]]


def test_a_batch_that_raises_fails_exactly_its_requests_with_the_plugins_error(held):
    with inline(size=3) as engine:
        occupy(engine, bp.batches)
        bad = [engine.submit(x(i)) for i in (0, 13, 2)]
        good = [engine.submit(x(3 + i)) for i in range(2)]
        held.set()
        for future in bad:
            with pytest.raises(ValueError, match="13 is unlucky"):
                future.result(10)
        assert [f.result(10)["x"] for f in good] == [3, 4]
        assert engine.replicas[0].healthy and engine.step(x(9))["x"] == 9


def test_a_result_of_the_wrong_length_fails_the_batch_and_says_why(held):
    with inline(size=2) as engine:
        occupy(engine, bp.batches)
        futures = [engine.submit(x(i, short=True)) for i in range(2)]
        held.set()
        for future in futures:
            with pytest.raises(ValueError, match="returned 1 results for a batch of 2 requests"):
                future.result(10)
        assert engine.step(x(5))["x"] == 5


def test_a_step_that_times_out_while_queued_is_cancelled_and_never_runs(held):
    with inline(size=4, delay_ms=0) as engine:
        occupy(engine, bp.batches)
        with pytest.raises(TimeoutError, match="cancelled while queued"):
            engine.step(x(7), timeout=0.05)
        held.set()
        assert engine.step(x(8), timeout=10)["x"] == 8
        assert 7 not in [i for batch in bp.batches for i in batch]


def test_one_request_waits_at_most_the_delay_for_company():
    with inline(size=16, delay_ms=30) as engine:
        engine.step(x(0))  # warm
        started = time.monotonic()
        assert engine.step(x(1), timeout=10)["batch"] == [1]
        assert 0.025 <= time.monotonic() - started < 5


def test_a_runner_with_only_execute_batch_runs_unbatched_requests_as_batches_of_one():
    with Engine(EngineArgs(plugin="tests.batch_plugins:BatchOnly", config=config(1))) as engine:
        assert engine.step(x(3)) == {"x": 3, "size": 1}


def test_priority_order_inline(held):
    with inline("SlowEcho", size=1) as engine:
        occupy(engine, bp.batches)
        order = [(0, 0), (1, 5), (2, 1), (3, 5), (4, 0), (5, 9), (6, -3)]
        futures = [engine.submit(x(i), priority=p) for i, p in order]
        held.set()
        for future in futures:
            future.result(10)
        assert [b[0] for b in bp.batches[1:]] == [5, 1, 3, 2, 0, 4, 6]
        assert set(engine.replicas[0].queue["levels"]) == {"100", "0", "5", "1", "9", "-3"}


def test_a_request_queued_behind_the_idle_runner_still_yields_to_a_higher_priority(held):
    """A server's I/O thread runs a request itself (``IdleRunner``) while the serve thread waits for
    the runner: what queued meanwhile is taken only once the runner is free, in priority order."""
    import threading

    with inline("SlowEcho", size=1) as engine:
        here = threading.Thread(target=engine.inline_runner().run, args=(x(-1, wait_gate=True), lambda: None))
        here.start()
        deadline = time.monotonic() + 10
        while not bp.batches and time.monotonic() < deadline:
            time.sleep(0.005)
        low = engine.submit(x(1))
        time.sleep(0.1)  # the serve thread is up and waiting for the runner
        high = engine.submit(x(2), priority=5)
        held.set()
        here.join(10)
        assert low.result(10)["n"] == 3 and high.result(10)["n"] == 2
        assert bp.batches == [[-1], [2], [1]]


def test_a_batch_is_filled_from_the_highest_levels_first(held):
    with inline(size=2) as engine:
        occupy(engine, bp.batches)
        futures = [engine.submit(x(i), priority=p) for i, p in [(0, 0), (1, 0), (2, 3), (3, 3), (4, 1)]]
        held.set()
        for future in futures:
            future.result(10)
        assert bp.batches[1:] == [[2, 3], [4, 0], [1]]


@pytest.mark.parametrize("bad, error", [("high", TypeError), (True, TypeError), (1.0, TypeError),
                                        (None, TypeError), (2 ** 40, ValueError), (-2 ** 31 - 1, ValueError)])
def test_a_bad_priority_is_refused_before_anything_runs(bad, error):
    with inline("SlowEcho", size=1) as engine:
        with pytest.raises(error, match="priority"):
            engine.submit(x(0), priority=bad)
        with pytest.raises(error, match="priority"):
            engine.step(x(0), priority=bad)
        assert engine.replicas[0].inflight == 0


def test_the_metrics_page_has_queue_waits_by_priority_and_batch_sizes(held):
    pytest.importorskip("prometheus_client")
    from runtime.serving.metrics import ServerMetrics

    with inline(size=4) as engine:
        occupy(engine, bp.batches)
        futures = [engine.submit(x(i), priority=i % 2) for i in range(6)]
        held.set()
        for future in futures:
            future.result(10)
        page = ServerMetrics(replicas=lambda: engine.replicas).render().decode()
    assert 'phyrt_queue_wait_seconds_count{priority="1",replica="0"} 3.0' in page
    assert 'phyrt_batch_size_bucket{le="4.0",replica="0"} 3.0' in page  # 1 + (3, 3) or (4, 2)...
    assert 'phyrt_batch_size_count{replica="0"} 3.0' in page


# -- local ranks ----------------------------------------------------------------------------


def local(plugin: str, devices: tuple[int, ...], cfg: EngineConfig, **supervisor) -> Engine:
    return Engine(EngineArgs(plugin=f"tests.batch_plugins:{plugin}", config=cfg),
                  deployment=DeploymentConfig.local(devices=devices,
                                                    process_config=WorkerSupervisorConfig(**supervisor)))


@pytest.fixture(scope="module")
def two_ranks():
    """One replica of 2 ranks, batching 4 with a 30 ms delay."""
    with local("BatchEcho", (0, 1), config(4, 30.0, tp=2)) as engine:
        yield engine


@pytest.mark.timeout(180)
def test_a_batch_across_two_ranks_is_the_same_batch_on_both(two_ranks):
    first = two_ranks.submit(x(-1, sleep=0.4))
    time.sleep(0.1)
    futures = {i: two_ranks.submit(x(i)) for i in range(9)}
    assert first.result(30)["batch"] == [-1]
    for i, future in futures.items():
        result = future.result(30)
        assert result["x"] == i and result["agree"] and result["rank"] == 0
    assert sorted(tuple(f.result()["batch"]) for f in futures.values()) == \
        sorted([(0, 1, 2, 3)] * 4 + [(4, 5, 6, 7)] * 4 + [(8,)])


@pytest.mark.timeout(180)
def test_priority_order_local_with_batches(two_ranks):
    first = two_ranks.submit(x(-1, sleep=0.4))
    time.sleep(0.1)  # the rest wait in the lanes: the ranks hold one batch at a time
    futures = {i: two_ranks.submit(x(i), priority=p) for i, p in [(0, 0), (1, 2), (2, 0), (3, 2), (4, 1)]}
    first.result(30)
    batches = {i: f.result(30)["batch"] for i, f in futures.items()}
    assert batches[1] == batches[3] == [1, 3, 4, 0]
    assert batches[2] == [2]


@pytest.mark.timeout(180)
def test_priority_order_local_unbatched_and_the_start_check():
    with local("SlowEcho", (0,), config(1)) as engine:
        first = engine.submit(x(-1, sleep=0.5))
        second = engine.submit(x(-2))  # the next request already waits in the ring
        time.sleep(0.1)
        futures = {i: engine.submit(x(i), priority=p) for i, p in [(0, 0), (1, 7), (2, 3), (3, 7)]}
        assert [first.result(30)["n"], second.result(30)["n"]] == [1, 2]
        assert sorted(futures, key=lambda i: futures[i].result(30)["n"]) == [1, 3, 2, 0]
        assert engine.replicas[0].queue["levels"]["7"]["count"] == 2
    with pytest.raises(WorkerStartupError, match="execute_batch"):
        local("SlowEcho", (0,), config(4, 1.0))


@pytest.mark.timeout(180)
def test_local_failing_batch_and_deadlines_from_submission():
    """A batch that raises fails the replica (the group rule) with the cause named; a deadline
    counts from submission, time in the lanes included."""
    with local("BatchEcho", (0,), config(2, 1.0)) as engine:
        futures = [engine.submit(x(i, **{"raise": "bad batch"})) for i in range(2)]
        for future in futures:
            with pytest.raises(EngineUnavailableError, match="ValueError: bad batch"):
                future.result(30)
    with local("BatchEcho", (0,), config(2, 1.0), execution_timeout_s=1.0) as engine:
        started = time.monotonic()
        first = engine.submit(x(0, sleep=0.7, tag="a"))
        time.sleep(0.05)
        queued = engine.submit(x(1, sleep=0.7, tag="b"))  # runs from 0.7 s: its deadline is at 1.05 s
        assert first.result(30)["x"] == 0
        with pytest.raises(EngineUnavailableError, match="execution timeout 1.0 s after submission"):
            queued.result(30)
        assert time.monotonic() - started < 1.4


# -- the lanes themselves -------------------------------------------------------------------


def test_lanes_order_batches_delay_and_close():
    from runtime.core.batch_key import batch_key
    from runtime.core.lanes import Lanes

    lanes = Lanes(3, 0.05, batch_key)
    assert lanes.due() is None and lanes.take() == []
    for name, key, priority in [("a", 1, 0), ("b", 2, 0), ("c", 1, 5)]:
        lanes.put(name, {"k": key}, priority)
    assert lanes.take() == []  # no key has 3 waiting, and the oldest came < 50 ms ago
    assert 0 < lanes.due() - time.monotonic() <= 0.05
    lanes.put("d", {"k": 1}, 0)  # key 1 has 3 waiting now: a batch is due at once
    lanes.put("e", {"k": 1}, 0)
    assert lanes.take() == ["c", "a", "d"]
    assert lanes.take() == []
    time.sleep(0.06)
    assert lanes.take() == ["b"] and lanes.take() == ["e"]
    lanes.put("f", {"k": 1}, 0)
    assert lanes.close("stopped") == ["f"]
    with pytest.raises(EngineUnavailableError, match="stopped"):
        lanes.put("g", {"k": 1}, 0)
    assert lanes.wait(block=True) == ([], True)
    stats = lanes.stats.snapshot()
    assert stats["batches"] == 3 and stats["batched"] == 5 and stats["levels"]["5"]["count"] == 1


def test_lanes_without_batching_take_one_at_a_time_and_bound_their_labels():
    from runtime.core.lanes import Lanes
    from runtime.core.queue_stats import MAX_LEVELS

    lanes = Lanes()
    for i in range(40):
        lanes.put(i, None, i)
    assert [lanes.take()[0] for _ in range(40)] == list(range(39, -1, -1))
    levels = lanes.stats.snapshot()["levels"]
    assert len(levels) == MAX_LEVELS + 1 and levels["other"]["count"] == 40 - MAX_LEVELS


# -- python -m runtime.launch ---------------------------------------------------------------


def test_the_launch_flags_reach_the_engine_config_and_bad_ones_exit_2():
    from runtime.launch import build_parser
    from runtime.serving.plan import build_engine_config
    from tests.test_launch import run_launch

    parse = build_parser().parse_args
    args, _ = build_engine_config(parse(["--device", "cpu"]))
    assert args.config.batching == BatchingConfig(1, 0.0)
    args, _ = build_engine_config(parse(["--device", "cpu", "--max-batch-size", "16", "--max-batch-delay-ms", "2.5"]))
    assert args.config.batching == BatchingConfig(16, 2.5)
    for bad in (["--max-batch-size", "0"], ["--max-batch-size", "x"], ["--max-batch-delay-ms", "-1"]):
        done = run_launch(*bad)
        assert done.returncode == 2 and ("max-batch" in done.stderr), done.stderr


@pytest.mark.timeout(150)
def test_a_served_engine_batches_concurrent_clients_by_priority(tmp_path):
    """Through the server: requests of several clients share batches, a higher priority goes first,
    and a plugin that cannot batch stops the start with the reason."""
    import numpy as np

    from runtime.client import Client
    from runtime.launch import EXIT_START_FAILED
    from tests.test_launch import Launched, run_launch

    server = Launched("--plugin", "tests.batch_plugins:BatchEcho", "--device", "cpu", "--max-batch-size", "4",
                      "--max-batch-delay-ms", "200", log_dir=tmp_path)
    try:
        clients = [Client(server.address) for _ in range(3)]
        try:
            busy = clients[0].submit({"x": np.array([0]), "sleep": 1.0})
            time.sleep(0.5)  # its batch went to the runner after the 200 ms delay: the rest queue behind it
            low = [c.submit({"x": np.array([i])}) for i, c in zip((1, 2), clients[1:])]
            high = clients[0].submit({"x": np.array([3])}, priority=5)
            assert busy.result(30)["batch"] == [0]
            assert high.result(30)["batch"] == [3, 1, 2] == low[0].result(30)["batch"] == low[1].result(30)["batch"]
        finally:
            for client in clients:
                client.close()
    finally:
        assert server.stop() == 0
    done = run_launch("--plugin", "tests.batch_plugins:SlowEcho", "--device", "cpu", "--max-batch-size", "4")
    assert done.returncode == EXIT_START_FAILED and "needs a runner with execute_batch" in done.stderr


@pytest.mark.timeout(180)
def test_sigkill_of_a_rank_mid_batch_fails_the_batch_and_the_queued_at_once_and_leaves_nothing():
    import os
    import signal

    from tests.conftest import close_engine, group_pids

    engine = local("BatchEcho", (0, 1), config(4, 20.0, tp=2))
    try:
        pids = group_pids(engine, 0)
        running = [engine.submit(x(i, sleep=5.0)) for i in range(2)]  # one batch of 2 on both ranks
        time.sleep(0.5)
        queued = [engine.submit(x(10 + i), priority=i) for i in range(3)]  # in the lanes: the window is full
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        for future in running + queued:
            exc = future.exception(timeout=max(0.01, killed_at + 1.5 - time.monotonic()))
            assert isinstance(exc, EngineUnavailableError) and "rank 1" in str(exc), repr(exc)
        assert not engine.replicas[0].healthy
    finally:
        close_engine(engine)  # ranks, run directory and segments: all gone
