"""runtime.parallel over real gloo process groups.

The test starts N copies of this file as rank processes (``python this_file SCENARIO
RANK WORLD PORT OUT_DIR``); each initializes the world, runs a scenario and writes
plain data to ``OUT_DIR/rank{R}.json``. The test process asserts on those files.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from runtime import parallel as P
from runtime.core.config import (
    AttentionParallelConfig,
    DenseParallelConfig,
    MoeParallelConfig,
    OuterParallelConfig,
    ParallelConfig,
)
from tests.ranks import finish, init_gloo, launch, rank_args

pytestmark = pytest.mark.timeout(120)


def rank_main(scenarios: dict) -> None:
    """Entry of a rank process: init the gloo world, run a scenario, write its result."""
    (scenario,), rank, world, port, out = rank_args(1)
    init_gloo(rank, world, port)
    try:
        result = scenarios[scenario](rank)
        dist.barrier()
    finally:
        P.destroy()
        dist.destroy_process_group()
    finish(out, rank, result)


def config(pp=1, cfg=1, dense=(1, None), attention=(1, 1, None), moe=(1, 1, None)) -> ParallelConfig:
    return ParallelConfig(
        outer=OuterParallelConfig(pipeline_size=pp, cfg_size=cfg),
        dense=DenseParallelConfig(*dense),
        attention=AttentionParallelConfig(*attention),
        moe=MoeParallelConfig(*moe),
    )


# --------------------------------------------------------------------------- rank side


def observe(rank: int, names: tuple[str, ...]) -> dict:
    """Run every collective on every named group; record what this rank saw."""
    seen = {}
    for name in names:
        x = torch.tensor([float(rank + 1), 2.0 * (rank + 1)])
        row = {"rank": P.rank(name), "size": P.size(name), "ranks": list(P.group_ranks(name))}
        row["sum"] = P.all_reduce(x.clone(), name).tolist()
        row["max"] = P.all_reduce(x.clone(), name, op="max").tolist()
        row["min"] = P.all_reduce(x.clone(), name, op="min").tolist()
        row["prod"] = P.all_reduce(x.clone(), name, op="prod").tolist()
        row["avg"] = P.all_reduce(x.clone(), name, op="avg").tolist()
        # a strided view is reduced in place through a contiguous buffer
        m = torch.full((2, 3), float(rank)).t()
        row["strided_sum"] = P.all_reduce(m, name)[:, 0].tolist()
        row["gather0"] = P.all_gather(torch.tensor([rank, 10 * rank]), name).tolist()
        row["gather1"] = P.all_gather(torch.tensor([[rank, 10 * rank]]), name, dim=1).tolist()
        last = P.size(name) - 1
        got = P.gather(torch.tensor([rank]), name, dst=last)
        row["gather_last"] = None if got is None else got.tolist()
        row["bcast_last"] = P.broadcast(torch.tensor([rank, rank]), name, src=last).tolist()
        P.barrier(name)
        seen[name] = row
    return seen


def scenario_two(rank: int) -> dict:
    bad = {}
    for label, (parallel, given) in {
        "world": (config(dense=(4, None)), rank),
        "rank": (config(dense=(2, None)), 1 - rank),
    }.items():
        try:
            P.initialize(parallel, given)
        except ValueError as exc:
            bad[label] = str(exc)
    try:
        P.size("dense_tp")
    except RuntimeError as exc:
        bad["uninitialized"] = str(exc)
    P.initialize(config(dense=(2, None)), rank)
    result = {"seen": observe(rank, P.GROUP_NAMES), "bad": bad,
              "cpu_group_is_world": P.cpu_group() is dist.group.WORLD, "output": P.is_output_rank()}
    return result


FOUR = {
    "cfg2_tp2": config(cfg=2, dense=(2, None)),
    "tp4": config(dense=(4, None), attention=(4, 1, None)),
    "att_cp_moe_ep": config(dense=(4, None), attention=(2, 2, None), moe=(2, 2, None)),
    "pp2_tp2": config(pp=2, dense=(2, None)),
}


def scenario_four(rank: int) -> dict:
    seen = {}
    for label, parallel in FOUR.items():
        P.initialize(parallel, rank)
        seen[label] = observe(rank, P.GROUP_NAMES)
        P.destroy()
    return seen


# --------------------------------------------------------------------------- test side


def expected(parallel: ParallelConfig, rank: int, name: str) -> dict:
    group = P.rank_groups(parallel, rank)[name]
    vals = [r + 1 for r in group]
    prod = 1.0
    for v in vals:
        prod *= v
    return {
        "rank": group.index(rank), "size": len(group), "ranks": list(group),
        "sum": [sum(vals), 2.0 * sum(vals)], "max": [max(vals), 2.0 * max(vals)],
        "min": [min(vals), 2.0 * min(vals)], "prod": [prod, prod * 2.0 ** len(vals)],
        "avg": [sum(vals) / len(vals), 2.0 * sum(vals) / len(vals)],
        "strided_sum": [float(sum(group))] * 3,
        "gather0": [v for r in group for v in (r, 10 * r)],
        "gather1": [[v for r in group for v in (r, 10 * r)]],
        "gather_last": list(group) if rank == group[-1] else None,
        "bcast_last": [group[-1], group[-1]],
    }


def check(parallel: ParallelConfig, results: list) -> None:
    for rank, seen in enumerate(results):
        for name in P.GROUP_NAMES:
            assert seen[name] == expected(parallel, rank, name), (rank, name)


def test_two_ranks_dense_tp2(tmp_path):
    results = launch(__file__, 2, tmp_path, args=["two"])
    check(config(dense=(2, None)), [r["seen"] for r in results])
    assert results[0]["seen"]["dense_tp"]["gather0"] == [0, 0, 1, 10]
    assert results[1]["seen"]["dense_tp"]["bcast_last"] == [1, 1]
    assert results[0]["seen"]["dense_dp"]["gather_last"] == [0]  # size 1: returns x
    assert [r["output"] for r in results] == [True, False]
    assert all(r["cpu_group_is_world"] for r in results)
    for rank, r in enumerate(results):
        assert "needs world size 4" in r["bad"]["world"] and "has world size 2" in r["bad"]["world"]
        assert f"given rank {1 - rank}" in r["bad"]["rank"] and r["bad"]["rank"].endswith(f"rank {rank}")
        assert "initialize() was not called" in r["bad"]["uninitialized"]


def test_four_ranks_several_topologies(tmp_path):
    results = launch(__file__, 4, tmp_path, args=["four"])
    for label, parallel in FOUR.items():
        check(parallel, [r[label] for r in results])
    cfg2 = [r["cfg2_tp2"] for r in results]
    assert [s["dense_tp"]["ranks"] for s in cfg2] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [s["cfg"]["ranks"] for s in cfg2] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [s["cfg"]["rank"] for s in cfg2] == [0, 0, 1, 1]
    assert [s["cfg"]["gather_last"] for s in cfg2] == [None, None, [0, 2], [1, 3]]
    assert [s["dense_tp"]["bcast_last"] for s in cfg2] == [[1, 1], [1, 1], [3, 3], [3, 3]]
    moe = [r["att_cp_moe_ep"]["moe_ep"]["ranks"] for r in results]
    assert moe == [[0, 2], [1, 3], [0, 2], [1, 3]]


if __name__ == "__main__":
    rank_main({"two": scenario_two, "four": scenario_four})
