"""``runtime.batching``: batch_key groups what ``stack`` can concatenate, ``unstack`` cuts a result
back, and the plugins' ``execute_batch`` gives what ``execute`` gives each request alone.

The 2-rank run starts two copies of this file as rank processes (``python this_file RANK WORLD
PORT OUT_DIR``) under dense tp 2; each runs the policy's ``execute_batch`` and writes its actions.
"""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple

import numpy as np
import pytest
import torch
import torch.distributed as dist

import runtime
from runtime import parallel as P
from runtime.batching import batch_key, leading_sizes, stack, unstack
from runtime.core.config import DenseParallelConfig, ParallelConfig
from runtime.core.plugins import BuildContext, resolve_plugin
from tests.ranks import finish, init_gloo, launch, rank_args

pytestmark = pytest.mark.timeout(120)

ARGS = {"obs_dim": 12, "act_dim": 3, "horizon": 4, "hidden": 64, "seed": 5}
LEADING = (1, 1, 3, 2, 1)
Pair = namedtuple("Pair", "left right")


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


# --------------------------------------------------------------------------- batch_key


@pytest.mark.parametrize("a, b", [
    ({"obs": t(1, 4)}, {"obs": t(3, 4)}),                                   # the leading dim is free
    ({"obs": np.zeros((1, 4), np.float32)}, {"obs": np.zeros((5, 4), np.float32)}),
    ({"obs": t(2, 4), "task": "pick"}, {"task": "pick", "obs": t(1, 4)}),   # dict order does not matter
    ({"a": {"b": [t(1, 2), (t(2), 3)]}}, {"a": {"b": [t(4, 2), (t(7), 3)]}}),
    ({"x": torch.tensor(1.0)}, {"x": torch.tensor(2.0)}),                   # 0-dim: dtype and device only
    ({"n": None, "b": b"raw", "f": 0.5, "flag": True}, {"n": None, "b": b"raw", "f": 0.5, "flag": True}),
])
def test_batch_key_is_equal_for_requests_that_stack(a, b):
    assert batch_key(a) == batch_key(b)
    assert hash(batch_key(a)) == hash(batch_key(b))


@pytest.mark.parametrize("a, b", [
    ({"obs": t(1, 4)}, {"obs": t(1, 5)}),                                   # a trailing dim
    ({"obs": t(1, 4, 2)}, {"obs": t(1, 4)}),                                # the number of dims
    ({"obs": t(1, 4)}, {"obs": t(1, 4, dtype=torch.float64)}),              # dtype
    ({"obs": t(1, 4)}, {"obs": t(1, 4, device="meta")}),                    # device
    ({"obs": t(1, 4)}, {"obs": np.zeros((1, 4), np.float32)}),              # tensor vs array
    ({"obs": t(1, 4), "task": "pick"}, {"obs": t(1, 4), "task": "place"}),  # a scalar field's value
    ({"obs": t(1, 4), "k": 1}, {"obs": t(1, 4), "k": 1.0}),                 # ... and its type
    ({"obs": t(1, 4), "k": 1}, {"obs": t(1, 4), "k": True}),
    ({"obs": t(1, 4), "task": "pick"}, {"obs": t(1, 4)}),                   # a missing key
    ({"xs": [t(1, 2)]}, {"xs": [t(1, 2), t(1, 2)]}),                        # a list's length
    ({"xs": [t(1, 2)]}, {"xs": (t(1, 2),)}),                                # list vs tuple
    ({"x": torch.tensor(1.0)}, {"x": t(1)}),                                # 0-dim vs 1-dim
])
def test_batch_key_differs_for_requests_that_do_not(a, b):
    assert batch_key(a) != batch_key(b)


def test_an_unhashable_leaf_makes_the_key_unique():
    request = {"obs": t(1, 4), "extra": {1, 2}}
    assert batch_key(request) != batch_key(request)
    hash(batch_key(request))


# --------------------------------------------------------------------------- stack / unstack


def requests_of(make, sizes=LEADING):
    gen = torch.Generator().manual_seed(1)
    return [make(torch.randn(b, 3, generator=gen), b) for b in sizes]


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("make", [
    lambda x, b: {"obs": x},
    lambda x, b: {"obs": x.numpy()},
    lambda x, b: {"inner": {"obs": x, "ids": torch.arange(b)}, "task": "pick", "tail": (x * 2, [x.numpy()])},
    lambda x, b: Pair(x, {"again": x + 1}),
    lambda x, b: [x, None, b"tag"],
], ids=["torch", "numpy", "nested", "namedtuple", "list"])
def test_stack_then_unstack_by_sizes_gives_the_requests_back(make):
    requests = requests_of(make)
    if not isinstance(requests[0], Pair):  # batch_key batches a tuple subclass alone; stack still takes it
        assert len({batch_key(r) for r in requests}) == 1
    batched = stack(requests)
    sizes = leading_sizes(requests)
    assert sizes == list(LEADING)
    assert_same(unstack(batched, sizes), requests)


def test_stack_concatenates_along_dim_0_and_takes_other_leaves_from_the_first():
    requests = [{"obs": torch.full((b, 2), float(b)), "task": "pick", "step": torch.tensor(b)} for b in (1, 3)]
    batched = stack(requests)
    assert batched["obs"].shape == (4, 2) and batched["obs"][:, 0].tolist() == [1, 3, 3, 3]
    assert batched["task"] == "pick"
    assert batched["step"].tolist() == [1, 3]  # 0-dim leaves become one row per request
    assert batched["obs"].data_ptr() not in (r["obs"].data_ptr() for r in requests)
    assert stack([requests[1]])["obs"].data_ptr() != requests[1]["obs"].data_ptr()


def test_unstack_by_count_cuts_equal_views_and_copies_other_leaves():
    result = {"x": torch.arange(12.0).reshape(6, 2), "pair": (np.arange(3), "meta"), "n": 7}
    pieces = unstack(result, 3)
    assert len(pieces) == 3
    assert [p["x"][:, 0].tolist() for p in pieces] == [[0, 2], [4, 6], [8, 10]]
    assert [p["pair"][0].tolist() for p in pieces] == [[0], [1], [2]]
    assert all(p["pair"][1] == "meta" and p["n"] == 7 for p in pieces)
    pieces[1]["x"][0, 0] = -1.0  # views: they share memory with the result
    assert result["x"][2, 0] == -1.0
    assert [p["x"].shape[0] for p in unstack({"x": result["x"]}, [0, 6, 0])] == [0, 6, 0]


def test_leading_sizes_at_a_path():
    requests = [{"meta": t(5, 1), "inputs": {"obs": t(b, 3)}} for b in (2, 4)]
    assert leading_sizes(requests) == [2, 4]  # "inputs" sorts before "meta"
    assert leading_sizes(requests, ("inputs", "obs")) == [2, 4]
    assert leading_sizes(requests, "meta") == [5, 5]
    with pytest.raises(ValueError, match="nothing at"):
        leading_sizes(requests, "obs")
    with pytest.raises(ValueError, match="no tensor or array"):
        leading_sizes([{"task": "pick"}])


@pytest.mark.parametrize("requests, match", [
    ([{"obs": t(1, 4)}, {"obs": t(1, 5)}], r"request\['obs'\]: request 1 has Tensor torch.float32 \[1, 5\]"),
    ([{"obs": t(1, 4)}, {"obs": t(1, 4, dtype=torch.float64)}], r"request\['obs'\].*float64"),
    ([{"a": {"b": "x"}}, {"a": {"b": "y"}}], r"request\['a'\]\['b'\]: request 1 has 'y', request 0 has 'x'"),
    ([{"obs": t(1)}, {"obs": t(1), "k": 1}], r"at request: request 1 has keys"),
    ([[t(1)], [t(1), t(1)]], r"at request: request 1 has length 2"),
    ([{"o": t(1)}, {"o": np.zeros(1, np.float32)}], r"request\['o'\]: request 1 has ndarray"),
    ([{"o": object()}, {"o": object()}], r"request\['o'\] is a object, which cannot be batched"),
    ([], "at least one request"),
])
def test_stack_refuses_requests_that_differ(requests, match):
    with pytest.raises(ValueError, match=match):
        stack(requests)


@pytest.mark.parametrize("n, match", [
    (4, "leading size 6, which n=4 does not divide"),
    (0, "n must be >= 1"),
    ([1, 2], r"sizes \[1, 2\] sum to 3"),
    ([], "non-empty"),
    ([7, -1], "ints >= 0"),
])
def test_unstack_refuses_a_bad_n(n, match):
    with pytest.raises(ValueError, match=match):
        unstack({"x": t(6, 2)}, n)
    with pytest.raises(ValueError, match="0-dim"):
        unstack({"x": torch.tensor(1.0)}, 1)


def test_runtime_batching_is_public_and_loads_neither_torch_nor_numpy():
    assert runtime.batching.stack is stack and "batching" in dir(runtime)
    code = "import sys, runtime.batching; assert not {'torch', 'numpy'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- the plugins' execute_batch


def context(rank: int = 0, parallel: ParallelConfig = ParallelConfig()) -> BuildContext:
    return BuildContext(rank=rank, world_size=parallel.infer_replica_world_size(), replica_index=0,
                        device=torch.device("cpu"), target="cpu", params_dtype=torch.float32,
                        parallel=parallel)


def observation_requests(obs_dim: int, numpy: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    obs = [torch.randn(b, obs_dim, generator=gen) for b in LEADING]
    return [{"obs": o.numpy() if numpy else o} for o in obs]


def assert_batch_equals_one_by_one(runner, requests):
    batched = runner.execute_batch(requests)
    alone = [runner.execute(r) for r in requests]
    assert isinstance(batched, list) and len(batched) == len(requests)
    for got, want in zip(batched, alone):
        assert list(got) == list(want) == ["actions"]
        assert got["actions"].dtype == want["actions"].dtype and got["actions"].shape == want["actions"].shape
        torch.testing.assert_close(got["actions"], want["actions"])


@pytest.mark.parametrize("numpy", [False, True], ids=["torch", "numpy"])
def test_policy_execute_batch_equals_execute_per_request(numpy):
    P.destroy()
    runner = resolve_plugin("policy")().build(context(), ARGS)
    assert_batch_equals_one_by_one(runner, observation_requests(ARGS["obs_dim"], numpy))


def test_own_policy_execute_batch_equals_execute_per_request(tmp_path):
    from examples.own_policy.make_weights import train
    from examples.own_policy.model import TinyPolicyConfig, save_policy
    from examples.own_policy.plugin import OwnPolicy

    config = TinyPolicyConfig(obs_dim=6, horizon=3, action_dim=2, hidden=16)
    save_policy(train(config, steps=5, seed=3)[0], tmp_path / "policy.safetensors")
    runner = OwnPolicy().build(context(), {"weights": str(tmp_path / "policy.safetensors")})
    assert_batch_equals_one_by_one(runner, observation_requests(config.obs_dim))


def rank_main() -> None:
    _, rank, world, port, out = rank_args()
    init_gloo(rank, world, port)
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=world))
    try:
        P.initialize(parallel, rank)
        runner = resolve_plugin("policy")().build(context(rank, parallel), ARGS)
        results = runner.execute_batch(observation_requests(ARGS["obs_dim"]))
    finally:
        P.destroy()
        dist.destroy_process_group()
    finish(out, rank, [r["actions"].tolist() for r in results])


def test_policy_execute_batch_at_tp2_equals_tp1_per_request(tmp_path):
    P.destroy()
    runner = resolve_plugin("policy")().build(context(), ARGS)
    want = [runner.execute(r)["actions"] for r in observation_requests(ARGS["obs_dim"])]
    for per_rank in launch(__file__, 2, tmp_path):
        assert len(per_rank) == len(want)
        for got, expected in zip(per_rank, want):
            torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=0)


if __name__ == "__main__":
    rank_main()
