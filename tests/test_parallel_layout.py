"""runtime.parallel without processes: the rank layout, and the one-rank (inline) API."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import parallel as P
from runtime.core.config import (
    AttentionParallelConfig,
    DenseParallelConfig,
    MoeParallelConfig,
    OuterParallelConfig,
    ParallelConfig,
)

pytestmark = pytest.mark.timeout(120)


def config(pp=1, cfg=1, dense=(1, None), attention=(1, 1, None), moe=(1, 1, None)) -> ParallelConfig:
    return ParallelConfig(
        outer=OuterParallelConfig(pipeline_size=pp, cfg_size=cfg),
        dense=DenseParallelConfig(*dense),
        attention=AttentionParallelConfig(*attention),
        moe=MoeParallelConfig(*moe),
    )


SPEC = config(cfg=2, dense=(4, None), attention=(4, 1, None), moe=(2, 2, None))


def coords(parallel: ParallelConfig, rank: int) -> dict[str, int]:
    """Invert the docstring's formulas: the index of ``rank`` in every dimension."""
    part = parallel.partition_size
    outer, local = divmod(rank, part)
    pp, cfg = divmod(outer, parallel.outer.cfg_size)
    d, a, m = parallel.dense, parallel.attention, parallel.moe
    dense_dp, dense_tp = divmod(local, d.tp_size)
    a_rest, attention_tp = divmod(local, a.tp_size)
    attention_dp, attention_cp = divmod(a_rest, a.cp_size)
    m_rest, moe_tp = divmod(local, m.tp_size)
    moe_dp, moe_ep = divmod(m_rest, m.ep_size)
    return {"pipeline": pp, "cfg": cfg, "dense_tp": dense_tp, "dense_dp": dense_dp,
            "attention_tp": attention_tp, "attention_cp": attention_cp, "attention_dp": attention_dp,
            "moe_tp": moe_tp, "moe_ep": moe_ep, "moe_dp": moe_dp}


def domain_of(name: str) -> list[str]:
    """The dimensions that a ``name`` group's members share (besides ``name`` itself)."""
    if name in ("pipeline", "cfg"):
        return ["pipeline", "cfg", "local"]
    prefix = name.split("_")[0]
    return ["pipeline", "cfg"] + [n for n in P.GROUP_NAMES if n.startswith(prefix + "_")]


def oracle_group(parallel: ParallelConfig, rank: int, name: str) -> tuple[int, ...]:
    world = range(parallel.infer_replica_world_size())
    if name == "world":
        return tuple(world)
    part = parallel.partition_size

    def key(r):
        c = dict(coords(parallel, r), local=r % part)
        return tuple(c[k] for k in domain_of(name) if k != name)

    members = [r for r in world if key(r) == key(rank)]
    return tuple(sorted(members, key=lambda r: coords(parallel, r)[name]))


def check_partitions(parallel: ParallelConfig) -> None:
    world = parallel.infer_replica_world_size()
    layout = P.group_layout(parallel)
    assert set(layout) == set(P.GROUP_NAMES)
    sizes = dict(parallel.domain_sizes(), world=world)
    for name, groups in layout.items():
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world)), name
        assert all(len(g) == sizes[name] for g in groups), name
        assert len(groups) == world // sizes[name], name
    for rank in range(world):
        mine = P.rank_groups(parallel, rank)
        for name in P.GROUP_NAMES:
            assert mine[name] == oracle_group(parallel, rank, name), (name, rank)
            assert mine[name] in layout[name]


def test_spec_example_exact_memberships():
    layout = P.group_layout(SPEC)
    assert layout["world"] == [tuple(range(8))]
    assert layout["cfg"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout["pipeline"] == [(r,) for r in range(8)]
    assert layout["dense_tp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout["dense_dp"] == [(r,) for r in range(8)]
    assert layout["attention_tp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout["attention_cp"] == layout["attention_dp"] == [(r,) for r in range(8)]
    assert layout["moe_tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout["moe_ep"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout["moe_dp"] == [(r,) for r in range(8)]
    assert P.rank_groups(SPEC, 6) == {
        "world": tuple(range(8)), "pipeline": (6,), "cfg": (2, 6), "dense_tp": (4, 5, 6, 7),
        "dense_dp": (6,), "attention_tp": (4, 5, 6, 7), "attention_cp": (6,), "attention_dp": (6,),
        "moe_tp": (6, 7), "moe_ep": (4, 6), "moe_dp": (6,),
    }
    check_partitions(SPEC)


def test_cfg2_dense_tp2_is_the_docstring_drawing():
    parallel = config(cfg=2, dense=(2, None))
    layout = P.group_layout(parallel)
    assert layout["dense_tp"] == [(0, 1), (2, 3)]
    assert layout["cfg"] == [(0, 2), (1, 3)]
    assert layout["dense_dp"] == layout["pipeline"] == [(0,), (1,), (2,), (3,)]
    # attention and moe were left alone, so they fill with dp over the partition of 2
    assert layout["attention_dp"] == layout["moe_dp"] == [(0, 1), (2, 3)]
    assert layout["attention_tp"] == [(0,), (1,), (2,), (3,)]
    check_partitions(parallel)


def test_pipeline_is_outermost():
    parallel = config(pp=2, cfg=2, dense=(2, None))
    layout = P.group_layout(parallel)
    assert layout["pipeline"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout["cfg"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout["dense_tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    check_partitions(parallel)


def test_attention_dp_cp_tp_order():
    # partition 8: attention tp 2 x cp 2 x dp 2; dense tp 2 x dp 4; moe tp 2 x ep 4
    parallel = config(dense=(2, None), attention=(2, 2, 2), moe=(2, 4, None))
    layout = P.group_layout(parallel)
    assert layout["attention_tp"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout["attention_cp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout["attention_dp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout["dense_dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout["moe_ep"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout["moe_dp"] == [(r,) for r in range(8)]
    check_partitions(parallel)


def test_moe_ep_without_tp_and_dense_dp():
    parallel = config(cfg=3, dense=(2, None), moe=(1, 4, None))
    layout = P.group_layout(parallel)
    assert layout["moe_ep"] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert layout["dense_dp"] == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11)]
    assert layout["cfg"] == [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]
    check_partitions(parallel)


def test_single_rank_layout():
    layout = P.group_layout(ParallelConfig())
    assert all(groups == [(0,)] for groups in layout.values())
    assert P.rank_groups(ParallelConfig(), 0) == {name: (0,) for name in P.GROUP_NAMES}


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 2), cfg=st.integers(1, 3), tp=st.sampled_from([1, 2, 4]),
       cp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]), mtp=st.sampled_from([1, 2]))
def test_every_layout_matches_the_formulas(pp, cfg, tp, cp, ep, mtp):
    try:
        parallel = config(pp=pp, cfg=cfg, dense=(tp, None), attention=(tp, cp, None), moe=(mtp, ep, None))
    except ValueError:
        return  # the domains cannot cover the same partition
    check_partitions(parallel)


def test_rank_groups_rejects_out_of_range():
    for bad in (-1, 8, 1.0, True, "0"):
        with pytest.raises(ValueError, match=r"\[0, 8\)"):
            P.rank_groups(SPEC, bad)
    with pytest.raises(TypeError):
        P.group_layout({"dense": 2})


# --------------------------------------------------------------------------- inline API


@pytest.fixture
def inline():
    P.destroy()
    yield
    P.destroy()


def test_not_initialized_is_one_rank(inline):
    assert not P.is_initialized() and P.cpu_group() is None
    x = torch.arange(6.0).reshape(2, 3)
    for name in P.GROUP_NAMES:
        assert (P.rank(name), P.size(name), P.group_ranks(name)) == (0, 1, (0,))
        assert P.all_reduce(x, name) is x
        assert P.all_reduce(x, name, op="max") is x
        assert P.all_gather(x, name, dim=1) is x
        assert P.gather(x, name) is x
        assert P.broadcast(x, name) is x
        P.barrier(name)
    assert P.is_output_rank()
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3))


def test_bad_names_ops_and_ranks_fail(inline):
    x = torch.ones(2)
    with pytest.raises(ValueError, match="dense_tp"):
        P.size("tp")
    with pytest.raises(ValueError, match="names"):
        P.all_reduce(x, "dense")
    with pytest.raises(ValueError, match="sum"):
        P.all_reduce(x, "world", op="mean")
    with pytest.raises(ValueError, match="dst"):
        P.gather(x, "world", dst=1)
    with pytest.raises(ValueError, match="src"):
        P.broadcast(x, "world", src=1)


def test_initialize_without_process_group(inline):
    # One rank needs no torch.distributed at all; more ranks do.
    P.initialize(ParallelConfig(), 0)
    assert P.is_initialized() and P.size("dense_tp") == 1 and P.cpu_group() is None
    assert P.parallel_config() == ParallelConfig()
    with pytest.raises(RuntimeError, match="already initialized"):
        P.initialize(ParallelConfig(), 0)
    P.destroy()
    assert not P.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        P.initialize(config(dense=(2, None)), 0)
    assert not P.is_initialized()
