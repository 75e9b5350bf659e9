"""Configs (runtime/config.py): frozen, validated, and the domain/mode rules users rely on.

Contract: DESIGN §2 and specs/parallel-serving.md ("Model parallelism", "Mode selection").
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime
from runtime.core.config import (
    AttentionParallelConfig,
    DenseParallelConfig,
    DeploymentConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    MoeParallelConfig,
    OuterParallelConfig,
    ParallelConfig,
    WorkerSupervisorConfig,
)

pytestmark = pytest.mark.timeout(60)

RULE = "dense.tp*dp = attention.tp*cp*dp = moe.tp*ep*dp"


def raises_naming(exc: type[BaseException], *parts: str):
    """``pytest.raises`` whose message must contain every part, in order."""
    return pytest.raises(exc, match=".*".join(re.escape(p) for p in parts))


# --------------------------------------------------------------------------- frozen


FROZEN_CASES = [
    (DeviceConfig(), "target", "cpu"),
    (OuterParallelConfig(), "cfg_size", 2),
    (DenseParallelConfig(), "tp_size", 2),
    (AttentionParallelConfig(), "cp_size", 2),
    (MoeParallelConfig(), "ep_size", 2),
    (ParallelConfig(), "dense", DenseParallelConfig(tp_size=2)),
    (EngineConfig(), "device", DeviceConfig(target="cpu")),
    (EngineArgs("anything"), "plugin", "other"),
    (WorkerSupervisorConfig(), "base_port", 30000),
    (DeploymentConfig(), "replica_count", 2),
]


@pytest.mark.parametrize("obj,field_name,value", FROZEN_CASES, ids=lambda v: type(v).__name__)
def test_every_config_is_a_frozen_dataclass(obj, field_name, value):
    assert dataclasses.is_dataclass(obj)
    before = getattr(obj, field_name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field_name, value)
    assert getattr(obj, field_name) == before


def test_filled_parallel_config_stays_frozen_and_hashable():
    cfg = ParallelConfig(dense=DenseParallelConfig(tp_size=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dense.dp_size = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.moe.dp_size = 5
    assert {cfg: "ok"}[ParallelConfig(dense=DenseParallelConfig(tp_size=2))] == "ok"


def test_public_api_exports_the_config_classes():
    from runtime.core import config

    for name in ("EngineArgs", "EngineConfig", "DeviceConfig", "ParallelConfig", "OuterParallelConfig",
                 "DenseParallelConfig", "AttentionParallelConfig", "MoeParallelConfig",
                 "DeploymentConfig", "WorkerSupervisorConfig"):
        assert getattr(runtime, name) is getattr(config, name)


# --------------------------------------------------------------------------- defaults (DESIGN §2)


def test_parallel_defaults_are_one_rank_with_dp_filling():
    assert OuterParallelConfig() == OuterParallelConfig(pipeline_size=1, cfg_size=1)
    dense, attention, moe = DenseParallelConfig(), AttentionParallelConfig(), MoeParallelConfig()
    assert (dense.tp_size, dense.dp_size) == (1, None)
    assert (attention.tp_size, attention.cp_size, attention.dp_size) == (1, 1, None)
    assert (moe.tp_size, moe.ep_size, moe.dp_size) == (1, 1, None)

    cfg = ParallelConfig()
    assert cfg.outer == OuterParallelConfig()
    assert (cfg.dense.dp_size, cfg.attention.dp_size, cfg.moe.dp_size) == (1, 1, 1)
    assert cfg.infer_replica_world_size() == 1


def test_engine_defaults():
    args = EngineArgs(plugin="policy")
    assert args.plugin_args is None
    assert args.config == EngineConfig()
    assert EngineConfig().device == DeviceConfig()
    assert EngineConfig().parallel == ParallelConfig()
    assert DeviceConfig().target == "auto"
    assert DeviceConfig().torch_dtype is torch.float32


def test_device_default_dtype_is_torch_float32_and_names_normalise():
    assert DeviceConfig().params_dtype == torch.float32
    assert DeviceConfig() == DeviceConfig(params_dtype=torch.float32)
    assert DeviceConfig(params_dtype="bfloat16") == DeviceConfig(params_dtype=torch.bfloat16)


def test_deployment_and_supervisor_defaults():
    dep = DeploymentConfig()
    assert (dep.mode, dep.replica_count, dep.devices) == ("auto", 1, None)
    assert dep.process_config == WorkerSupervisorConfig()
    sup = WorkerSupervisorConfig()
    assert sup.base_port is None  # a free rendezvous (a file store in the run directory)
    assert sup.execution_timeout_s is None
    assert 0 < sup.heartbeat_interval_s < sup.heartbeat_timeout_s
    assert sup.startup_timeout_s > 0 and math.isfinite(sup.startup_timeout_s)


# --------------------------------------------------------------------------- int fields


INT_FIELDS = [
    (OuterParallelConfig, "OuterParallelConfig", "pipeline_size"),
    (OuterParallelConfig, "OuterParallelConfig", "cfg_size"),
    (DenseParallelConfig, "DenseParallelConfig", "tp_size"),
    (DenseParallelConfig, "DenseParallelConfig", "dp_size"),
    (AttentionParallelConfig, "AttentionParallelConfig", "tp_size"),
    (AttentionParallelConfig, "AttentionParallelConfig", "cp_size"),
    (AttentionParallelConfig, "AttentionParallelConfig", "dp_size"),
    (MoeParallelConfig, "MoeParallelConfig", "tp_size"),
    (MoeParallelConfig, "MoeParallelConfig", "ep_size"),
    (MoeParallelConfig, "MoeParallelConfig", "dp_size"),
]


@pytest.mark.parametrize("cls,owner,name", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, -8])
def test_sizes_below_one_raise_value_error_naming_field_and_value(cls, owner, name, bad):
    with raises_naming(ValueError, f"{owner}.{name}", ">= 1", str(bad)):
        cls(**{name: bad})


@pytest.mark.parametrize("cls,owner,name", INT_FIELDS)
@pytest.mark.parametrize("bad", [2.0, "2", True, [2]])
def test_non_int_sizes_raise_type_error_naming_field_and_value(cls, owner, name, bad):
    with raises_naming(TypeError, f"{owner}.{name}", "int", repr(bad)):
        cls(**{name: bad})


def test_dp_none_is_accepted_only_for_dp_fields():
    assert DenseParallelConfig(dp_size=None).dp_size is None
    with raises_naming(TypeError, "DenseParallelConfig.tp_size", "None"):
        DenseParallelConfig(tp_size=None)
    with raises_naming(TypeError, "OuterParallelConfig.cfg_size", "None"):
        OuterParallelConfig(cfg_size=None)


@pytest.mark.parametrize("field_name,cls", [("outer", OuterParallelConfig), ("dense", DenseParallelConfig),
                                            ("attention", AttentionParallelConfig), ("moe", MoeParallelConfig)])
def test_parallel_config_members_must_have_their_own_type(field_name, cls):
    wrong = {"tp_size": 2} if field_name != "outer" else {"cfg_size": 2}
    with raises_naming(TypeError, f"ParallelConfig.{field_name}", cls.__name__, repr(wrong)):
        ParallelConfig(**{field_name: wrong})
    # a sibling domain's config is also the wrong type
    other = MoeParallelConfig() if cls is not MoeParallelConfig else DenseParallelConfig()
    with pytest.raises(TypeError, match=f"ParallelConfig.{field_name}"):
        ParallelConfig(**{field_name: other})


def test_engine_config_and_args_check_types():
    with raises_naming(TypeError, "EngineConfig.device", "DeviceConfig", "'cpu'"):
        EngineConfig(device="cpu")
    with raises_naming(TypeError, "EngineConfig.parallel", "ParallelConfig"):
        EngineConfig(parallel=ParallelConfig().to_dict())
    with raises_naming(TypeError, "EngineArgs.config", "EngineConfig"):
        EngineArgs("policy", config=ParallelConfig())
    for bad in (None, 3, b"policy"):
        with raises_naming(TypeError, "EngineArgs.plugin", repr(bad)):
            EngineArgs(bad)
    with pytest.raises((TypeError, ValueError), match="EngineArgs.plugin"):
        EngineArgs("")


# --------------------------------------------------------------------------- the domain rule


def test_spec_dense_and_attention_tp2_fills_moe_dp():
    cfg = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
    assert cfg.dense == DenseParallelConfig(tp_size=2, dp_size=1)
    assert cfg.attention == AttentionParallelConfig(tp_size=2, cp_size=1, dp_size=1)
    assert cfg.moe == MoeParallelConfig(tp_size=1, ep_size=1, dp_size=2)
    assert cfg.infer_replica_world_size() == 2


def test_spec_cfg2_dense4_attention4_moe_tp2_ep2_is_eight_ranks():
    cfg = ParallelConfig(
        outer=OuterParallelConfig(cfg_size=2),
        dense=DenseParallelConfig(tp_size=4),
        attention=AttentionParallelConfig(tp_size=4),
        moe=MoeParallelConfig(tp_size=2, ep_size=2),
    )
    assert (cfg.dense.dp_size, cfg.attention.dp_size, cfg.moe.dp_size) == (1, 1, 1)
    assert cfg.infer_replica_world_size() == 8
    sizes = cfg.domain_sizes()
    assert sizes == {
        "pipeline": 1, "cfg": 2,
        "dense_tp": 4, "dense_dp": 1,
        "attention_tp": 4, "attention_cp": 1, "attention_dp": 1,
        "moe_tp": 2, "moe_ep": 2, "moe_dp": 1,
    }


def test_dense_tp4_with_attention_tp2_dp1_raises_with_the_counts():
    with raises_naming(ValueError, RULE, "dense.tp*dp=4", "attention.tp*cp*dp=2", "attention",
                       "2 ranks", "dp_size=1", "partition has 4"):
        ParallelConfig(dense=DenseParallelConfig(tp_size=4),
                       attention=AttentionParallelConfig(tp_size=2, dp_size=1))


def test_dense_tp4_with_attention_tp3_raises_with_the_counts():
    with raises_naming(ValueError, RULE, "dense.tp*dp=4", "attention.tp*cp*dp=3",
                       "attention splits 3 ranks", "partition of 4"):
        ParallelConfig(dense=DenseParallelConfig(tp_size=4), attention=AttentionParallelConfig(tp_size=3))


def test_mismatch_in_moe_and_between_explicit_dps_raises():
    with raises_naming(ValueError, RULE, "moe splits 3 ranks", "partition of 4"):
        ParallelConfig(dense=DenseParallelConfig(tp_size=4), moe=MoeParallelConfig(ep_size=3))
    with raises_naming(ValueError, RULE, "dense covers 2 ranks", "partition has 4"):
        ParallelConfig(dense=DenseParallelConfig(tp_size=2, dp_size=1),
                       attention=AttentionParallelConfig(tp_size=2, cp_size=2))
    # cp counts in attention: tp 2 x cp 2 = 4 ranks, dense fills dp 2
    cfg = ParallelConfig(attention=AttentionParallelConfig(tp_size=2, cp_size=2))
    assert cfg.dense.dp_size == 4 and cfg.moe.dp_size == 4
    assert cfg.infer_replica_world_size() == 4


def test_explicit_dp_equal_to_the_fill_compares_equal_to_none_form():
    implicit = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
    explicit = ParallelConfig(
        dense=DenseParallelConfig(tp_size=2, dp_size=1),
        attention=AttentionParallelConfig(tp_size=2, cp_size=1, dp_size=1),
        moe=MoeParallelConfig(tp_size=1, ep_size=1, dp_size=2),
    )
    assert implicit == explicit
    assert hash(implicit) == hash(explicit)
    assert ParallelConfig() == ParallelConfig(dense=DenseParallelConfig(dp_size=1),
                                              attention=AttentionParallelConfig(dp_size=1),
                                              moe=MoeParallelConfig(dp_size=1))


def test_filling_does_not_mutate_the_caller_objects():
    moe = MoeParallelConfig()
    dense = DenseParallelConfig(tp_size=4)
    cfg = ParallelConfig(dense=dense, moe=moe)
    assert cfg.moe.dp_size == 4
    assert moe.dp_size is None and dense.dp_size is None
    # reusing the same unfilled objects in another topology fills differently
    assert ParallelConfig(dense=DenseParallelConfig(tp_size=2), moe=moe).moe.dp_size == 2


def test_explicit_dp_may_set_the_partition():
    cfg = ParallelConfig(dense=DenseParallelConfig(tp_size=1, dp_size=4), attention=AttentionParallelConfig(tp_size=2))
    assert cfg.attention.dp_size == 2 and cfg.moe.dp_size == 4
    assert cfg.infer_replica_world_size() == 4


@pytest.mark.parametrize("pipeline,cfg_size,tp,expected", [
    (1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 4), (2, 3, 4, 24), (3, 1, 2, 6),
])
def test_pipeline_times_cfg_times_partition(pipeline, cfg_size, tp, expected):
    cfg = ParallelConfig(outer=OuterParallelConfig(pipeline_size=pipeline, cfg_size=cfg_size),
                         dense=DenseParallelConfig(tp_size=tp))
    assert cfg.infer_replica_world_size() == expected
    assert cfg.partition_size == tp


# Small powers of two make consistent layouts common; 3 and 6 make the divisibility rule bite.
SIZES = st.sampled_from([1, 1, 2, 2, 4, 3, 6, 8])
MAYBE = st.one_of(st.none(), st.none(), SIZES)


def _covered(domain) -> int:
    return math.prod(domain.split_sizes().values()) * domain.dp_size


@settings(max_examples=200, deadline=None)
@given(pipeline=SIZES, cfg_size=SIZES, d_tp=SIZES, d_dp=MAYBE, a_tp=SIZES, a_cp=SIZES, a_dp=MAYBE,
       m_tp=SIZES, m_ep=SIZES, m_dp=MAYBE)
def test_property_domains_cover_the_same_ranks_or_construction_raises(
        pipeline, cfg_size, d_tp, d_dp, a_tp, a_cp, a_dp, m_tp, m_ep, m_dp):
    parts = dict(
        outer=OuterParallelConfig(pipeline_size=pipeline, cfg_size=cfg_size),
        dense=DenseParallelConfig(tp_size=d_tp, dp_size=d_dp),
        attention=AttentionParallelConfig(tp_size=a_tp, cp_size=a_cp, dp_size=a_dp),
        moe=MoeParallelConfig(tp_size=m_tp, ep_size=m_ep, dp_size=m_dp),
    )
    # Independent oracle of DESIGN §2: partition = largest product of given sizes;
    # a None dp must divide it exactly, an explicit dp must match it.
    splits = {"dense": d_tp, "attention": a_tp * a_cp, "moe": m_tp * m_ep}
    dps = {"dense": d_dp, "attention": a_dp, "moe": m_dp}
    partition = max(splits[k] * (dps[k] or 1) for k in splits)
    valid = all(partition % splits[k] == 0 if dps[k] is None else splits[k] * dps[k] == partition
                for k in splits)
    try:
        cfg = ParallelConfig(**parts)
    except ValueError as exc:
        assert not valid, f"valid layout rejected: {exc}"
        assert RULE in str(exc)
        return
    assert valid, f"invalid layout accepted: {cfg}"
    counts = {_covered(cfg.dense), _covered(cfg.attention), _covered(cfg.moe)}
    assert counts == {partition}
    assert cfg.infer_replica_world_size() == pipeline * cfg_size * partition
    # explicit sizes survive; every dp is an int afterwards
    assert (cfg.dense.tp_size, cfg.attention.tp_size, cfg.attention.cp_size, cfg.moe.tp_size,
            cfg.moe.ep_size) == (d_tp, a_tp, a_cp, m_tp, m_ep)
    for given_dp, domain in ((d_dp, cfg.dense), (a_dp, cfg.attention), (m_dp, cfg.moe)):
        assert isinstance(domain.dp_size, int)
        if given_dp is not None:
            assert domain.dp_size == given_dp
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg


@st.composite
def consistent_layouts(draw):
    """Layouts valid by construction: every domain's splits divide one partition."""
    partition = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
    divisors = [d for d in range(1, partition + 1) if partition % d == 0]

    def split(n):
        sizes = []
        rest = partition
        for _ in range(n):
            size = draw(st.sampled_from([d for d in divisors if rest % d == 0]))
            sizes.append(size)
            rest //= size
        dp = draw(st.one_of(st.none(), st.just(rest)))
        return sizes, dp, rest

    return partition, split(1), split(2), split(2)


@settings(max_examples=200, deadline=None)
@given(layout=consistent_layouts(), pipeline=SIZES, cfg_size=SIZES)
def test_property_consistent_layouts_are_accepted_and_filled(layout, pipeline, cfg_size):
    partition, ((d_tp,), d_dp, d_fill), ((a_tp, a_cp), a_dp, a_fill), ((m_tp, m_ep), m_dp, m_fill) = layout
    parts = dict(
        outer=OuterParallelConfig(pipeline_size=pipeline, cfg_size=cfg_size),
        dense=DenseParallelConfig(tp_size=d_tp, dp_size=d_dp),
        attention=AttentionParallelConfig(tp_size=a_tp, cp_size=a_cp, dp_size=a_dp),
        moe=MoeParallelConfig(tp_size=m_tp, ep_size=m_ep, dp_size=m_dp),
    )
    splits = (d_tp, a_tp * a_cp, m_tp * m_ep)
    if d_dp is None and a_dp is None and m_dp is None:
        # Nothing pins the partition: it is the largest split (DESIGN §2), not their
        # least common multiple, so e.g. attention cp 2 with moe ep 3 has no fill.
        expected = max(splits)
        if any(expected % s for s in splits):
            with raises_naming(ValueError, RULE, "does not divide the partition of"):
                ParallelConfig(**parts)
            return
    else:
        expected = partition
    cfg = ParallelConfig(**parts)
    assert {_covered(cfg.dense), _covered(cfg.attention), _covered(cfg.moe)} == {expected}
    assert cfg.infer_replica_world_size() == pipeline * cfg_size * expected
    if expected == partition:
        assert (cfg.dense.dp_size, cfg.attention.dp_size, cfg.moe.dp_size) == (d_fill, a_fill, m_fill)


def test_to_dict_is_plain_data_and_round_trips():
    cfg = ParallelConfig(
        outer=OuterParallelConfig(pipeline_size=2, cfg_size=2),
        dense=DenseParallelConfig(tp_size=4),
        attention=AttentionParallelConfig(tp_size=2, cp_size=2),
        moe=MoeParallelConfig(tp_size=2, ep_size=2),
    )
    data = cfg.to_dict()
    assert data == {
        "outer": {"pipeline_size": 2, "cfg_size": 2},
        "dense": {"tp_size": 4, "dp_size": 1},
        "attention": {"tp_size": 2, "cp_size": 2, "dp_size": 1},
        "moe": {"tp_size": 2, "ep_size": 2, "dp_size": 1},
    }
    assert json.loads(json.dumps(data)) == data
    assert ParallelConfig.from_dict(json.loads(json.dumps(data))) == cfg
    msgpack = pytest.importorskip("msgpack")
    assert ParallelConfig.from_dict(msgpack.unpackb(msgpack.packb(data))) == cfg


def test_from_dict_validates_like_the_constructor():
    data = ParallelConfig().to_dict()
    data["dense"] = {"tp_size": 4, "dp_size": None}
    data["attention"] = {"tp_size": 3, "cp_size": 1, "dp_size": None}
    with raises_naming(ValueError, RULE):
        ParallelConfig.from_dict(data)
    data = ParallelConfig().to_dict()
    data["moe"]["ep_size"] = "2"
    with pytest.raises(TypeError, match="MoeParallelConfig.ep_size"):
        ParallelConfig.from_dict(data)


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("target", ["auto", "cuda", "cpu"])
def test_device_targets_accepted(target):
    assert DeviceConfig(target=target).target == target


@pytest.mark.parametrize("target", ["gpu", "CPU", "cuda:0", ""])
def test_device_unknown_target_raises(target):
    with raises_naming(ValueError, "DeviceConfig.target", "'auto'", "'cuda'", "'cpu'", repr(target)):
        DeviceConfig(target=target)


@pytest.mark.parametrize("given,expected", [
    (torch.float32, torch.float32), ("float32", torch.float32),
    (torch.bfloat16, torch.bfloat16), ("bfloat16", torch.bfloat16),
    (torch.float16, torch.float16), ("float16", torch.float16),
    (torch.float64, torch.float64), ("float64", torch.float64),
])
def test_params_dtype_as_torch_dtype_or_name(given, expected):
    assert DeviceConfig(params_dtype=given).torch_dtype is expected


@pytest.mark.parametrize("bad", ["int8", torch.int8, torch.int64, "fp32", "torch.float32", "Float32"])
def test_params_dtype_outside_the_float_types_raises(bad):
    with raises_naming(ValueError, "DeviceConfig.params_dtype", "float32", repr(bad)):
        DeviceConfig(params_dtype=bad)


def test_resolve_target_on_this_machine():
    if torch.cuda.is_available():
        assert DeviceConfig().resolve_target() == "cuda"
        assert DeviceConfig(target="cuda").resolve_target() == "cuda"
    else:
        assert DeviceConfig().resolve_target() == "cpu"
        with raises_naming(ValueError, "target='cuda'", "no CUDA"):
            DeviceConfig(target="cuda").resolve_target()
    assert DeviceConfig(target="cpu").resolve_target() == "cpu"


@pytest.mark.parametrize("available", [False, True])
def test_resolve_target_follows_cuda_availability(monkeypatch, available):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert DeviceConfig(target="auto").resolve_target() == ("cuda" if available else "cpu")
    assert DeviceConfig(target="cpu").resolve_target() == "cpu"
    if available:
        assert DeviceConfig(target="cuda").resolve_target() == "cuda"
    else:
        with pytest.raises(ValueError, match="cuda"):
            DeviceConfig(target="cuda").resolve_target()


# --------------------------------------------------------------------------- wrong types that are only ValueErrors


WRONG_TYPES = [
    pytest.param(lambda: DeviceConfig(target=1), "DeviceConfig.target", id="device-target-int"),
    pytest.param(lambda: DeviceConfig(params_dtype=1), "DeviceConfig.params_dtype", id="dtype-int"),
    pytest.param(lambda: DeviceConfig(params_dtype=None), "DeviceConfig.params_dtype", id="dtype-none"),
    pytest.param(lambda: DeploymentConfig(mode=1), "DeploymentConfig.mode", id="mode-int"),
    pytest.param(lambda: DeploymentConfig(devices=(0, "1")), "DeploymentConfig.devices", id="devices-str"),
    pytest.param(lambda: DeploymentConfig(devices=(0, 1.0)), "DeploymentConfig.devices", id="devices-float"),
    pytest.param(lambda: DeploymentConfig(devices=(True,)), "DeploymentConfig.devices", id="devices-bool"),
]


@pytest.mark.parametrize("build,field_name", WRONG_TYPES)
def test_wrong_typed_values_are_rejected_naming_the_field(build, field_name):
    with pytest.raises((TypeError, ValueError), match=re.escape(field_name)):
        build()


@pytest.mark.parametrize("build,field_name", WRONG_TYPES)
def test_wrong_typed_values_raise_type_error(build, field_name):
    with pytest.raises(TypeError, match=re.escape(field_name)):
        build()


# --------------------------------------------------------------------------- deployment: mode selection


@pytest.mark.parametrize("ranks,replicas,devices,expected", [
    (1, 1, None, "inline"),        # one rank, one replica, no explicit placement
    (2, 1, None, "local"),         # more than one rank
    (8, 1, None, "local"),
    (1, 2, None, "local"),         # more than one replica
    (1, 1, (0,), "local"),         # explicit devices
    (1, 1, (3,), "local"),
    (2, 2, (0, 1, 2, 3), "local"),
])
def test_auto_mode_follows_the_spec_table(ranks, replicas, devices, expected):
    dep = DeploymentConfig(replica_count=replicas, devices=devices)
    assert dep.mode == "auto"
    assert dep.resolve_mode(ranks) == expected


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_external_resolves_to_external(ranks):
    dep = DeploymentConfig.external()
    assert dep.mode == "external" and dep.replica_count == 1
    assert dep.resolve_mode(ranks) == "external"


@pytest.mark.parametrize("ranks", [1, 4])
def test_explicit_local_stays_local(ranks):
    assert DeploymentConfig(mode="local").resolve_mode(ranks) == "local"


def test_explicit_inline_with_one_rank_is_inline():
    assert DeploymentConfig(mode="inline").resolve_mode(1) == "inline"


def test_explicit_inline_with_two_ranks_or_replicas_raises():
    with raises_naming(ValueError, "inline", "2 ranks per replica", "1 replicas", "mode='local'"):
        DeploymentConfig(mode="inline").resolve_mode(2)
    with raises_naming(ValueError, "inline", "1 ranks per replica", "2 replicas"):
        DeploymentConfig(mode="inline", replica_count=2).resolve_mode(1)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), ("1", TypeError), (1.0, TypeError)])
def test_resolve_mode_checks_ranks_per_replica(bad, exc):
    with pytest.raises(exc, match="ranks_per_replica"):
        DeploymentConfig().resolve_mode(bad)


@pytest.mark.parametrize("mode", ["Auto", "multiprocess", "", "torchrun"])
def test_unknown_mode_raises(mode):
    with raises_naming(ValueError, "DeploymentConfig.mode", "'inline'", "'local'", "'external'", repr(mode)):
        DeploymentConfig(mode=mode)


def test_external_with_two_replicas_raises():
    with raises_naming(ValueError, "external", "replica_count=2"):
        DeploymentConfig(mode="external", replica_count=2)


def test_local_constructor_sets_mode_and_keeps_its_arguments():
    sup = WorkerSupervisorConfig(base_port=30000)
    dep = DeploymentConfig.local(devices=[0, 1, 2, 3], replica_count=2, process_config=sup)
    assert dep.mode == "local"
    assert dep.devices == (0, 1, 2, 3)
    assert dep.replica_count == 2
    assert dep.process_config is sup
    assert dep.resolve_mode(2) == "local"
    bare = DeploymentConfig.local()
    assert (bare.mode, bare.devices, bare.replica_count) == ("local", None, 1)
    assert bare.process_config == WorkerSupervisorConfig()
    assert bare.resolve_mode(1) == "local"


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("2", TypeError)])
def test_replica_count_validation(bad, exc):
    with raises_naming(exc, "DeploymentConfig.replica_count", str(bad)):
        DeploymentConfig(replica_count=bad)


def test_process_config_must_be_a_worker_supervisor_config():
    with raises_naming(TypeError, "DeploymentConfig.process_config", "WorkerSupervisorConfig"):
        DeploymentConfig(process_config={"base_port": 29500})


# --------------------------------------------------------------------------- deployment: devices and placement


def test_placement_splits_devices_per_replica_in_order():
    dep = DeploymentConfig.local(devices=(0, 1, 2, 3), replica_count=2)
    assert dep.placement(2) == [(0, 1), (2, 3)]
    assert DeploymentConfig(devices=(5, 3, 7, 1), replica_count=2).placement(2) == [(5, 3), (7, 1)]
    assert DeploymentConfig(devices=(4, 5, 6, 7), replica_count=4).placement(1) == [(4,), (5,), (6,), (7,)]
    assert DeploymentConfig(devices=(2, 3)).placement(2) == [(2, 3)]


def test_placement_without_devices_counts_up_from_zero():
    assert DeploymentConfig().placement(1) == [(0,)]
    assert DeploymentConfig(replica_count=3).placement(2) == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize("devices,replicas,ranks", [
    ((0, 1, 2), 2, 2), ((0, 1, 2, 3, 4), 2, 2), ((0,), 1, 2), ((0, 1), 1, 1),
])
def test_placement_with_the_wrong_number_of_devices_names_the_counts(devices, replicas, ranks):
    dep = DeploymentConfig(devices=devices, replica_count=replicas)
    with raises_naming(ValueError, f"has {len(devices)} entries", f"replica_count {replicas}",
                       f"ranks_per_replica {ranks}", f"= {replicas * ranks}"):
        dep.placement(ranks)


def test_devices_any_int_iterable_becomes_a_tuple():
    assert DeploymentConfig(devices=[0, 1]).devices == (0, 1)
    assert DeploymentConfig(devices=range(4)).devices == (0, 1, 2, 3)
    dep = DeploymentConfig(devices=iter([3, 1]))
    assert dep.devices == (3, 1)
    assert DeploymentConfig(devices=[0, 1]) == DeploymentConfig(devices=(0, 1))
    hash(DeploymentConfig(devices=[0, 1]))


@pytest.mark.parametrize("devices", [(-1,), (0, -2)])
def test_negative_devices_raise(devices):
    with raises_naming(ValueError, "DeploymentConfig.devices", ">= 0", str(min(devices))):
        DeploymentConfig(devices=devices)


@pytest.mark.parametrize("devices", [(0, 0), (1, 2, 1)])
def test_repeated_devices_raise(devices):
    with raises_naming(ValueError, "DeploymentConfig.devices", "repeat", str(devices)):
        DeploymentConfig(devices=devices)


@pytest.mark.parametrize("devices", [(), []])
def test_empty_devices_raise(devices):
    with raises_naming(ValueError, "DeploymentConfig.devices", "empty"):
        DeploymentConfig(devices=devices)


@pytest.mark.parametrize("devices", ["0,1", b"\x00\x01", 3, 1.5])
def test_devices_that_are_not_a_sequence_raise_type_error(devices):
    with raises_naming(TypeError, "DeploymentConfig.devices", repr(devices)):
        DeploymentConfig(devices=devices)


def test_local_constructor_validates_devices_too():
    with pytest.raises(ValueError, match="repeat"):
        DeploymentConfig.local(devices=(0, 0))


# --------------------------------------------------------------------------- supervisor config


@pytest.mark.parametrize("port", [1, 1024, 29500, 65535])
def test_base_port_in_range(port):
    assert WorkerSupervisorConfig(base_port=port).base_port == port


@pytest.mark.parametrize("port,rule", [(0, ">= 1"), (-1, ">= 1"), (65536, "<= 65535"), (100000, "<= 65535")])
def test_base_port_out_of_range_raises(port, rule):
    with raises_naming(ValueError, "WorkerSupervisorConfig.base_port", rule, str(port)):
        WorkerSupervisorConfig(base_port=port)


@pytest.mark.parametrize("port", ["29500", 29500.0, True])
def test_base_port_wrong_type_raises(port):
    with raises_naming(TypeError, "WorkerSupervisorConfig.base_port", repr(port)):
        WorkerSupervisorConfig(base_port=port)


SECONDS_FIELDS = ["heartbeat_interval_s", "heartbeat_timeout_s", "startup_timeout_s", "execution_timeout_s"]


def _seconds_kwargs(name, value):
    # keep timeout > interval so that only the field under test is wrong
    kwargs = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0}
    kwargs[name] = value
    if name == "heartbeat_interval_s":
        kwargs.pop("heartbeat_timeout_s")
    return kwargs


@pytest.mark.parametrize("name", SECONDS_FIELDS)
@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, float("nan"), float("inf"), float("-inf")])
def test_seconds_must_be_finite_and_positive(name, bad):
    with raises_naming(ValueError, f"WorkerSupervisorConfig.{name}", "finite", "> 0", repr(bad)):
        WorkerSupervisorConfig(**_seconds_kwargs(name, bad))


@pytest.mark.parametrize("name", SECONDS_FIELDS)
@pytest.mark.parametrize("bad", ["1", True, [1.0]])
def test_seconds_of_wrong_type_raise_type_error(name, bad):
    with raises_naming(TypeError, f"WorkerSupervisorConfig.{name}", repr(bad)):
        WorkerSupervisorConfig(**_seconds_kwargs(name, bad))


@pytest.mark.parametrize("name", ["heartbeat_interval_s", "heartbeat_timeout_s", "startup_timeout_s"])
def test_only_execution_timeout_may_be_none(name):
    with pytest.raises(TypeError, match=f"WorkerSupervisorConfig.{name}"):
        WorkerSupervisorConfig(**_seconds_kwargs(name, None))
    assert WorkerSupervisorConfig(execution_timeout_s=None).execution_timeout_s is None


def test_seconds_accept_ints_and_floats():
    cfg = WorkerSupervisorConfig(execution_timeout_s=3, heartbeat_interval_s=1, heartbeat_timeout_s=2,
                                 startup_timeout_s=30)
    assert (cfg.execution_timeout_s, cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s, cfg.startup_timeout_s) \
        == (3, 1, 2, 30)
    assert WorkerSupervisorConfig(execution_timeout_s=0.25).execution_timeout_s == 0.25


@pytest.mark.parametrize("interval,timeout", [(1.0, 1.0), (2.0, 1.0), (10.0, 0.5)])
def test_heartbeat_timeout_must_exceed_interval(interval, timeout):
    with raises_naming(ValueError, "heartbeat_timeout_s must exceed heartbeat_interval_s",
                       f"timeout {timeout}", f"interval {interval}"):
        WorkerSupervisorConfig(heartbeat_interval_s=interval, heartbeat_timeout_s=timeout)


def test_heartbeat_timeout_just_above_interval_is_fine():
    cfg = WorkerSupervisorConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.001)
    assert cfg.heartbeat_timeout_s > cfg.heartbeat_interval_s
