"""Local replicas that stay healthy: group layout, collectives, routing, big tensors,
the policy demo against inline, and peers that are not ranks.

Engines here are shared per module (each start costs seconds of spawn + torch import);
nothing in this file takes a replica down. After every test and after the module,
``tests/conftest.py`` checks that no process, segment or run directory is left.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import zmq

from runtime import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                     EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)
from runtime import parallel as P
from tests.conftest import close_engine, free_base_port, start_engine, supervisor_of, tp_parallel

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]

TP2 = tp_parallel(2)
CFG2_TP2 = tp_parallel(2, cfg=2)


@pytest.fixture(scope="module")
def tp2x2(no_leaks_at_module_end):
    """devices=(0, 1, 2, 3), replica_count=2, dense tp 2 + attention tp 2."""
    engine = start_engine(parallel=TP2, replicas=2)
    yield engine
    close_engine(engine)


@pytest.fixture(scope="module")
def cfg2tp2(no_leaks_at_module_end):
    """One replica of 4 ranks: cfg 2 x (dense tp 2 + attention tp 2)."""
    engine = start_engine(parallel=CFG2_TP2, replicas=1)
    yield engine
    close_engine(engine)


def each_replica(engine, request: dict, count: int) -> dict[int, dict]:
    """``request``'s answer from every replica: idle replicas take turns (ties rotate)."""
    answers = {}
    for _ in range(2 * count):
        answer = engine.step(request, timeout=30)
        answers[answer["replica"][0] if isinstance(answer["replica"], list) else answer["replica"]] = answer
        if len(answers) == count:
            break
    assert sorted(answers) == list(range(count))
    return answers


def check_layout(seen: dict, parallel: ParallelConfig, replica: int) -> None:
    world = parallel.infer_replica_world_size()
    assert seen["world_rank"] == list(range(world))
    assert seen["ctx_rank"] == list(range(world))  # BuildContext.rank is the replica-local rank
    assert seen["ctx_world_size"] == [world] * world
    assert seen["replica"] == [replica] * world
    for rank in range(world):
        expected = P.rank_groups(parallel, rank)
        for name in P.GROUP_NAMES:
            assert tuple(seen["groups"][name][rank]) == expected[name], (name, rank)
            assert seen["group_rank"][name][rank] == expected[name].index(rank), (name, rank)


# --------------------------------------------------------------------------- layout and collectives


def test_tp2_groups_follow_the_layout_on_both_replicas(tp2x2):
    answers = each_replica(tp2x2, {"op": "groups"}, 2)
    for replica, seen in answers.items():
        check_layout(seen, TP2, replica)
        assert seen["groups"]["dense_tp"] == [[0, 1], [0, 1]]
        assert seen["groups"]["cfg"] == [[0], [1]]
    pids = answers[0]["pid"] + answers[1]["pid"]
    assert len(set(pids)) == 4  # four distinct rank processes


def test_cfg2_tp2_groups_follow_the_documented_example(cfg2tp2):
    seen = cfg2tp2.step({"op": "groups"}, timeout=30)
    check_layout(seen, CFG2_TP2, 0)
    # the example drawn in runtime/parallel.py's docstring, literally
    assert seen["groups"]["dense_tp"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert seen["groups"]["attention_tp"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert seen["groups"]["cfg"] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert seen["groups"]["pipeline"] == [[0], [1], [2], [3]]
    assert seen["groups"]["dense_dp"] == [[0], [1], [2], [3]]
    assert seen["group_rank"]["cfg"] == [0, 0, 1, 1]
    assert seen["group_rank"]["dense_tp"] == [0, 1, 0, 1]


@pytest.mark.parametrize("group, reduce, expected", [
    ("dense_tp", "sum", [3.0, 3.0]),
    ("attention_tp", "sum", [3.0, 3.0]),
    ("world", "sum", [3.0, 3.0]),
    ("world", "max", [2.0, 2.0]),
    ("cfg", "sum", [1.0, 2.0]),  # cfg 1: single-rank groups, each rank keeps its value
])
def test_tp2_all_reduce(tp2x2, group, reduce, expected):
    for _ in range(2):  # consecutive requests alternate over the two idle replicas
        assert tp2x2.step({"op": "all_reduce", "group": group, "reduce": reduce}, timeout=30) == expected


@pytest.mark.parametrize("group, reduce, expected", [
    ("dense_tp", "sum", [3.0, 3.0, 7.0, 7.0]),  # (0, 1) -> 1 + 2, (2, 3) -> 3 + 4
    ("cfg", "sum", [4.0, 6.0, 4.0, 6.0]),       # (0, 2) -> 1 + 3, (1, 3) -> 2 + 4
    ("world", "sum", [10.0] * 4),
    ("world", "avg", [2.5] * 4),
    ("pipeline", "sum", [1.0, 2.0, 3.0, 4.0]),
])
def test_cfg2_tp2_all_reduce(cfg2tp2, group, reduce, expected):
    assert cfg2tp2.step({"op": "all_reduce", "group": group, "reduce": reduce}, timeout=30) == expected


# --------------------------------------------------------------------------- routing


def test_the_ranks_share_the_usable_cores_between_them(tp2x2):
    """No core is kept back for the engine process (its work for a request comes before and
    after its ranks compute): 1 rank gets every core; 4 ranks a quarter each (at least 1)."""
    from runtime.transport.spin import usable_cores

    cores = usable_cores()
    engine = start_engine()
    try:
        assert engine.step({"op": "threads"}, timeout=30)["threads"] == [[cores]]
    finally:
        close_engine(engine)
    for replica in each_replica(tp2x2, {"op": "threads"}, 2).values():
        assert replica["threads"] == [[max(1, cores // 4)]] * 2


def test_concurrent_requests_land_on_different_replicas(tp2x2):
    started = time.monotonic()
    futures = [tp2x2.submit({"op": "sleep", "s": 1.0}) for _ in range(2)]
    assert [s.inflight for s in tp2x2.replicas] == [1, 1]
    results = [f.result(30) for f in futures]
    elapsed = time.monotonic() - started
    assert {r["replica"] for r in results} == {0, 1}
    assert elapsed < 1.9, f"two 1 s requests took {elapsed:.2f} s: they did not run side by side"
    assert [s.inflight for s in tp2x2.replicas] == [0, 0]


def test_least_in_flight_not_round_robin(tp2x2):
    """While one replica is busy, every new request goes to the idle one."""
    busy = tp2x2.submit({"op": "sleep", "s": 2.0})
    busy_replica = next(s.index for s in tp2x2.replicas if s.inflight == 1)
    quick = [tp2x2.step({"op": "pid"}, timeout=30)["replica"] for _ in range(3)]
    assert quick == [1 - busy_replica] * 3  # round-robin would have sent one of them to the busy replica
    assert busy.result(30)["replica"] == busy_replica


def test_load_spreads_evenly(tp2x2):
    futures = [tp2x2.submit({"op": "sleep", "s": 0.3}) for _ in range(4)]
    assert [s.inflight for s in tp2x2.replicas] == [2, 2]
    replicas = [f.result(30)["replica"] for f in futures]
    assert sorted(replicas) == [0, 0, 1, 1]


def test_a_running_local_request_cannot_be_cancelled(tp2x2):
    future = tp2x2.submit({"op": "sleep", "s": 0.5})
    time.sleep(0.1)
    cancelled = future.cancel()
    inflight = sum(s.inflight for s in tp2x2.replicas)
    time.sleep(0.7)  # the ranks finish it either way; leave the engine idle for the next test
    assert not cancelled, "cancel() returned True for a request the ranks were running"
    assert inflight == 1


def test_validate_request_runs_in_the_caller(tp2x2):
    with pytest.raises(ValueError, match="'op'"):
        tp2x2.submit({"op": "no-such-op"})
    assert all(s.healthy and s.inflight == 0 for s in tp2x2.replicas)


# --------------------------------------------------------------------------- tensors


def test_64_mib_tensor_in_and_out(tp2x2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16 << 20, generator=gen)  # 64 MiB of float32
    assert x.numel() * x.element_size() == 64 << 20
    small = torch.arange(10, dtype=torch.int64)
    out = tp2x2.step({"op": "echo", "x": {"big": x, "small": small, "flags": x[:100] > 0}}, timeout=60)
    assert torch.equal(out["big"], x)
    assert torch.equal(out["small"], small) and out["small"].dtype == torch.int64
    assert torch.equal(out["flags"], x[:100] > 0)
    # the other replica too (idle replicas take turns)
    again = tp2x2.step({"op": "echo", "x": x}, timeout=60)
    assert torch.equal(again, x)


def test_a_result_stays_valid_while_the_engine_lives(tp2x2):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16 << 20, generator=gen)
    keep = [tp2x2.step({"op": "echo", "x": x}, timeout=60) for _ in range(2)]  # one per replica
    # more large traffic through the same arenas, with garbage collection in between
    for i in range(4):
        other = tp2x2.step({"op": "echo", "x": torch.full((16 << 20,), float(i))}, timeout=60)
        assert bool((other == float(i)).all())
        del other
        gc.collect()
        time.sleep(0.1)  # lets the supervisor hand freed blocks back to the ranks
    for kept in keep:
        assert torch.equal(kept, x)
    # and a kept result is an ordinary tensor: it can be cloned and edited
    copy = keep[0].clone()
    copy.add_(1)
    assert torch.equal(keep[0], x)


# --------------------------------------------------------------------------- strangers


def test_a_peer_that_is_not_a_rank_is_ignored(tp2x2):
    sup = supervisor_of(tp2x2)
    ctx = zmq.Context()
    try:
        heartbeats = sup.address.rsplit("/", 1)[0] + "/hb"
        for address in (sup.address, heartbeats):
            # a rank's heartbeat name on the ctl socket, and its ctl name on the heartbeat socket
            impostor = b"h-0-1" if address == sup.address else b"c-0-1"
            for identity in (b"c-7-0", b"c-0-9", b"x-intruder", b"h-5-5", impostor):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, identity)
                sock.connect(address)
                sock.send(b"garbage")
                sock.send_multipart([b"more", b"frames"])
        time.sleep(0.3)
    finally:
        ctx.destroy(linger=0)
    assert all(s.healthy for s in tp2x2.replicas)
    each_replica(tp2x2, {"op": "pid"}, 2)


# --------------------------------------------------------------------------- the policy demo


@pytest.mark.timeout(120)
def test_policy_spec_snippet_matches_inline(no_leaks_at_module_end):
    """The spec's local multi-GPU snippet with runtime names on CPU: same actions as inline (on CPU
    too: both sides pinned, so that the comparison is on one device wherever CUDA is visible)."""
    obs = torch.randn(4, 32, generator=torch.Generator().manual_seed(11))
    with Engine(EngineArgs(plugin="policy", config=EngineConfig(device=DeviceConfig(target="cpu")))) as inline:
        assert inline.mode == "inline"
        want = inline.step({"obs": obs})["actions"]

    engine = Engine(
        EngineArgs(
            plugin="policy",
            plugin_args=None,
            config=EngineConfig(
                device=DeviceConfig(target="cpu"),
                parallel=ParallelConfig(
                    dense=DenseParallelConfig(tp_size=2),
                    attention=AttentionParallelConfig(tp_size=2),
                ),
            ),
        ),
        deployment=DeploymentConfig.local(
            devices=(0, 1, 2, 3),
            replica_count=2,
            process_config=WorkerSupervisorConfig(base_port=free_base_port(2)),
        ),
    )
    from tests import conftest
    conftest.LIVE[id(engine)] = engine
    try:
        assert engine.mode == "local" and engine.ranks_per_replica == 2
        futures = [engine.submit({"obs": obs}) for _ in range(2)]
        assert [s.inflight for s in engine.replicas] == [1, 1]  # one request on each replica
        for future in futures:
            got = future.result(60)["actions"]
            assert got.shape == want.shape == (4, 8, 7)
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    finally:
        close_engine(engine)
