"""How a replica is cut up: ``ParallelConfig`` and its domains, frozen and validated.

Leaf module: imports only ``runtime.core.checks``; no torch.

The layout (``ParallelConfig``):

    outer:      pipeline_size x cfg_size partitions, each the same shape
    per partition, three views of the same pool of ranks:
        dense       tp x dp
        attention   tp x cp x dp
        moe         tp x ep x dp

Every ``dp_size`` defaults to ``None``, "fill the partition": the partition is
the largest product of any domain's given sizes, and a ``None`` dp becomes
partition / (that domain's other sizes), which must divide exactly. After
construction every dp is an ``int``, so two configs that describe the same layout
compare equal however they were written.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from runtime.core.checks import check_int


@dataclass(frozen=True)
class OuterParallelConfig:
    """Dimensions that apply to every domain: pipeline stages and CFG branches."""

    pipeline_size: int = 1
    cfg_size: int = 1

    def __post_init__(self) -> None:
        check_int("OuterParallelConfig", "pipeline_size", self.pipeline_size)
        check_int("OuterParallelConfig", "cfg_size", self.cfg_size)


@dataclass(frozen=True)
class DenseParallelConfig:
    """Dense layers: tensor parallel x data parallel (dp None fills the partition)."""

    tp_size: int = 1
    dp_size: int | None = None

    def __post_init__(self) -> None:
        check_int("DenseParallelConfig", "tp_size", self.tp_size)
        if self.dp_size is not None:
            check_int("DenseParallelConfig", "dp_size", self.dp_size)

    def split_sizes(self) -> dict[str, int]:
        return {"tp": self.tp_size}


@dataclass(frozen=True)
class AttentionParallelConfig:
    """Attention: tensor parallel x context parallel x data parallel."""

    tp_size: int = 1
    cp_size: int = 1
    dp_size: int | None = None

    def __post_init__(self) -> None:
        check_int("AttentionParallelConfig", "tp_size", self.tp_size)
        check_int("AttentionParallelConfig", "cp_size", self.cp_size)
        if self.dp_size is not None:
            check_int("AttentionParallelConfig", "dp_size", self.dp_size)

    def split_sizes(self) -> dict[str, int]:
        return {"tp": self.tp_size, "cp": self.cp_size}


@dataclass(frozen=True)
class MoeParallelConfig:
    """Mixture-of-experts layers: tensor parallel x expert parallel x data parallel."""

    tp_size: int = 1
    ep_size: int = 1
    dp_size: int | None = None

    def __post_init__(self) -> None:
        check_int("MoeParallelConfig", "tp_size", self.tp_size)
        check_int("MoeParallelConfig", "ep_size", self.ep_size)
        if self.dp_size is not None:
            check_int("MoeParallelConfig", "dp_size", self.dp_size)

    def split_sizes(self) -> dict[str, int]:
        return {"tp": self.tp_size, "ep": self.ep_size}


DOMAINS = ("dense", "attention", "moe")


@dataclass(frozen=True)
class ParallelConfig:
    """How one replica is cut into ranks. See the module docstring for the rule."""

    outer: OuterParallelConfig = field(default_factory=OuterParallelConfig)
    dense: DenseParallelConfig = field(default_factory=DenseParallelConfig)
    attention: AttentionParallelConfig = field(default_factory=AttentionParallelConfig)
    moe: MoeParallelConfig = field(default_factory=MoeParallelConfig)

    def __post_init__(self) -> None:
        expected = {
            "outer": OuterParallelConfig,
            "dense": DenseParallelConfig,
            "attention": AttentionParallelConfig,
            "moe": MoeParallelConfig,
        }
        for name, cls in expected.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(f"ParallelConfig.{name} must be a {cls.__name__}, got {value!r}")

        given = {}
        for name in DOMAINS:
            domain = getattr(self, name)
            product = math.prod(domain.split_sizes().values())
            given[name] = product * (domain.dp_size or 1)
        partition = max(given.values())

        filled = {}
        for name in DOMAINS:
            domain = getattr(self, name)
            splits = math.prod(domain.split_sizes().values())
            if domain.dp_size is None:
                if partition % splits:
                    raise ValueError(self._rule_message(
                        f"{name} splits {splits} ranks, which does not divide the partition of "
                        f"{partition} ranks (so its dp_size cannot fill it)"))
                filled[name] = dataclasses.replace(domain, dp_size=partition // splits)
            elif splits * domain.dp_size != partition:
                raise ValueError(self._rule_message(
                    f"{name} covers {splits * domain.dp_size} ranks with its explicit "
                    f"dp_size={domain.dp_size}, but the partition has {partition}"))
        for name, domain in filled.items():
            object.__setattr__(self, name, domain)

    def _rule_message(self, detail: str) -> str:
        covered = []
        for name in DOMAINS:
            domain = getattr(self, name)
            splits = math.prod(domain.split_sizes().values())
            label = {"dense": "dense.tp*dp", "attention": "attention.tp*cp*dp", "moe": "moe.tp*ep*dp"}[name]
            if domain.dp_size is None:
                covered.append(f"{label}={splits}*fill")
            else:
                covered.append(f"{label}={splits * domain.dp_size}")
        return (
            "the three domains must cover the same number of ranks "
            f"(dense.tp*dp = attention.tp*cp*dp = moe.tp*ep*dp), got {', '.join(covered)}: {detail}"
        )

    @property
    def partition_size(self) -> int:
        """Ranks inside one pipeline/CFG partition (every domain covers exactly these)."""
        return self.dense.tp_size * self.dense.dp_size

    def infer_replica_world_size(self) -> int:
        """pipeline x cfg x partition: the number of ranks one replica needs."""
        return self.outer.pipeline_size * self.outer.cfg_size * self.partition_size

    def domain_sizes(self) -> dict[str, int]:
        """Every named dimension's size, e.g. ``{"dense_tp": 2, "moe_ep": 1, ...}``."""
        d, a, m = self.dense, self.attention, self.moe
        return {
            "pipeline": self.outer.pipeline_size,
            "cfg": self.outer.cfg_size,
            "dense_tp": d.tp_size, "dense_dp": d.dp_size,
            "attention_tp": a.tp_size, "attention_cp": a.cp_size, "attention_dp": a.dp_size,
            "moe_tp": m.tp_size, "moe_ep": m.ep_size, "moe_dp": m.dp_size,
        }

    def to_dict(self) -> dict[str, dict[str, int]]:
        """Plain data (msgpack-able); ``from_dict`` inverts it."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in ("outer",) + DOMAINS}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, int]]) -> "ParallelConfig":
        return cls(
            outer=OuterParallelConfig(**data["outer"]),
            dense=DenseParallelConfig(**data["dense"]),
            attention=AttentionParallelConfig(**data["attention"]),
            moe=MoeParallelConfig(**data["moe"]),
        )
