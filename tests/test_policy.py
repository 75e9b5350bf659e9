"""The built-in demo plugin ``policy``: found by name, validated, deterministic, tp-invariant.

The 2-rank run starts two copies of this file as rank processes (``python this_file
RANK WORLD PORT OUT_DIR``) under dense tp 2; each writes its actions as JSON.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

from runtime import parallel as P
from runtime.core.config import DenseParallelConfig, OuterParallelConfig, ParallelConfig
from runtime.core.plugins import BuildContext, resolve_plugin
from tests.ranks import finish, init_gloo, launch, rank_args

pytestmark = pytest.mark.timeout(120)

ARGS = {"obs_dim": 12, "act_dim": 3, "horizon": 4, "hidden": 64, "seed": 5}


def context(rank: int = 0, parallel: ParallelConfig = ParallelConfig()) -> BuildContext:
    return BuildContext(rank=rank, world_size=parallel.infer_replica_world_size(), replica_index=0,
                        device=torch.device("cpu"), target="cpu", params_dtype=torch.float32,
                        parallel=parallel)


def observations(batch: int = 3, obs_dim: int = 12) -> torch.Tensor:
    return torch.randn(batch, obs_dim, generator=torch.Generator().manual_seed(11))


@pytest.fixture
def entry():
    P.destroy()
    cls = resolve_plugin("policy")  # through the phyrt.plugins entry point
    assert cls.name == "policy" and cls.parallel_domains == frozenset({"dense", "attention"})
    return cls()


def test_defaults_shape_and_dtype(entry):
    runner = entry.build(context(), None)
    actions = runner.execute({"obs": observations(5, 32)})["actions"]
    assert actions.shape == (5, 8, 7) and actions.dtype == torch.float32
    assert actions.device.type == "cpu" and not actions.is_inference()
    assert bool((actions.abs() <= 1).all())


def test_deterministic_per_seed(entry):
    obs = observations()
    first = entry.build(context(), ARGS).execute({"obs": obs})["actions"]
    again = entry.build(context(), dict(ARGS)).execute({"obs": obs.numpy()})["actions"]
    other = entry.build(context(), ARGS | {"seed": 6}).execute({"obs": obs})["actions"]
    assert first.shape == (3, 4, 3)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other, atol=1e-3)
    # rows are independent: one observation alone gives its row of the batch
    alone = entry.build(context(), ARGS).execute({"obs": obs[1:2]})["actions"]
    assert torch.allclose(alone[0], first[1], atol=1e-6)


def test_other_params_dtype(entry):
    ctx = BuildContext(rank=0, world_size=1, replica_index=0, device="cpu", target="cpu",
                       params_dtype="bfloat16", parallel=ParallelConfig())
    actions = entry.build(ctx, ARGS).execute({"obs": observations()})["actions"]
    want = entry.build(context(), ARGS).execute({"obs": observations()})["actions"]
    assert actions.dtype == torch.float32 and torch.allclose(actions, want, atol=0.1)


@pytest.mark.parametrize("args, error, match", [
    ([1, 2], TypeError, "dict"),
    ({"obs_dims": 3}, ValueError, "unknown keys \\['obs_dims'\\]"),
    ({"hidden": 0}, ValueError, "hidden"),
    ({"horizon": 2.0}, TypeError, "horizon"),
    ({"seed": True}, TypeError, "seed"),
    ({"seed": -1}, ValueError, "seed"),
])
def test_plugin_args_are_validated(entry, args, error, match):
    with pytest.raises(error, match=match):
        entry.configure(args)
    with pytest.raises(error, match=match):
        entry.build(context(), args)


def test_validate_request(entry):
    good = observations(2, 32)
    entry.validate_request({"obs": good})  # not configured: the default obs_dim is not assumed
    entry.validate_request({"obs": observations(2, 12)})
    entry.validate_request({"obs": good.numpy()})
    entry.configure(None)
    bad = [
        ([good], TypeError, "dict"),
        ({"obs": good.tolist()}, TypeError, "numpy"),
        ({"obs": good, "extra": 1}, ValueError, "exactly the key 'obs'"),
        ({"observation": good}, ValueError, "exactly the key 'obs'"),
        ({"obs": good.double()}, ValueError, "float32"),
        ({"obs": good.numpy().astype(np.float64)}, ValueError, "float32"),
        ({"obs": good[0]}, ValueError, "shape"),
        ({"obs": torch.zeros(0, 32)}, ValueError, "shape"),
        ({"obs": observations(2, 12)}, ValueError, "32"),
        ({"obs": torch.full((2, 32), float("nan"))}, ValueError, "NaN"),
        ({"obs": torch.full((2, 32), float("inf")).numpy()}, ValueError, "NaN or inf"),
    ]
    for request, error, match in bad:
        with pytest.raises(error, match=match):
            entry.validate_request(request)
    entry.validate_request({"obs": good})


def test_execute_checks_obs_dim(entry):
    runner = entry.build(context(), ARGS)
    with pytest.raises(ValueError, match=r"\[B, 12\]"):
        runner.execute({"obs": observations(2, 32)})


def test_validate_parallel(entry):
    entry.validate_parallel(ParallelConfig(dense=DenseParallelConfig(tp_size=2)))
    with pytest.raises(ValueError, match="cfg"):
        entry.validate_parallel(ParallelConfig(outer=OuterParallelConfig(cfg_size=2)))
    entry.configure(ARGS | {"hidden": 66})
    with pytest.raises(ValueError, match="hidden 66 .* dense.tp_size 4"):
        entry.validate_parallel(ParallelConfig(dense=DenseParallelConfig(tp_size=4)))


# --------------------------------------------------------------------------- 2 real ranks


def rank_main() -> None:
    _, rank, world, port, out = rank_args()
    init_gloo(rank, world, port)
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=world))
    try:
        P.initialize(parallel, rank)
        runner = resolve_plugin("policy")().build(context(rank, parallel), ARGS)
        actions = runner.execute({"obs": observations()})["actions"]
    finally:
        P.destroy()
        dist.destroy_process_group()
    finish(out, rank, actions.tolist())


def test_two_ranks_tp2_equal_tp1(tmp_path, entry):
    want = entry.build(context(), ARGS).execute({"obs": observations()})["actions"]
    for actions in launch(__file__, 2, tmp_path):
        got = torch.tensor(actions)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=0)


if __name__ == "__main__":
    rank_main()
