"""Configuration objects: frozen dataclasses, validated when they are built.

Leaf module: imports nothing else from the project (``supervisor`` and ``workers``
import it, never the other way round). It imports torch for dtypes; the torch-free
client never imports it.

How a replica is cut up (``ParallelConfig``):

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
from typing import Any

import torch

_TARGETS = ("auto", "cuda", "cpu")
_MODES = ("auto", "inline", "local", "external")
_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")


def _check_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def _check_seconds(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}.{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a finite number of seconds > 0, got {value!r}")


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class DeviceConfig:
    """Where a rank's parameters live.

    ``target``: "auto" (cuda when available, else cpu with gloo), "cuda" or "cpu".
    ``params_dtype``: a ``torch.dtype`` or its name ("float32", "bfloat16", ...).
    """

    target: str = "auto"
    params_dtype: Any = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.target, str):
            raise TypeError(f"DeviceConfig.target must be a string, one of {_TARGETS}, got {self.target!r}")
        if self.target not in _TARGETS:
            raise ValueError(f"DeviceConfig.target must be one of {_TARGETS}, got {self.target!r}")
        if not isinstance(self.params_dtype, (str, torch.dtype)):
            raise TypeError(
                f"DeviceConfig.params_dtype must be a torch.dtype or its name, got {self.params_dtype!r}"
            )
        if dtype_name(self.params_dtype) not in _DTYPE_NAMES:
            raise ValueError(
                f"DeviceConfig.params_dtype must be one of {_DTYPE_NAMES}, got {self.params_dtype!r}"
            )
        # one spelling, so that configs compare equal however the dtype was written
        object.__setattr__(self, "params_dtype", getattr(torch, dtype_name(self.params_dtype)))

    def resolve_target(self) -> str:
        """"cuda" or "cpu"; asking for cuda on a machine without it is an error."""
        if self.target == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.target == "cuda" and not torch.cuda.is_available():
            raise ValueError("DeviceConfig.target='cuda' but torch sees no CUDA device on this machine")
        return self.target

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.params_dtype


def dtype_name(dtype: Any) -> str:
    """"float32" for ``torch.float32`` or "float32"; other values are returned as text."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


# --------------------------------------------------------------------------- parallelism


@dataclass(frozen=True)
class OuterParallelConfig:
    """Dimensions that apply to every domain: pipeline stages and CFG branches."""

    pipeline_size: int = 1
    cfg_size: int = 1

    def __post_init__(self) -> None:
        _check_int("OuterParallelConfig", "pipeline_size", self.pipeline_size)
        _check_int("OuterParallelConfig", "cfg_size", self.cfg_size)


@dataclass(frozen=True)
class DenseParallelConfig:
    """Dense layers: tensor parallel x data parallel (dp None fills the partition)."""

    tp_size: int = 1
    dp_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("DenseParallelConfig", "tp_size", self.tp_size)
        if self.dp_size is not None:
            _check_int("DenseParallelConfig", "dp_size", self.dp_size)

    def split_sizes(self) -> dict[str, int]:
        return {"tp": self.tp_size}


@dataclass(frozen=True)
class AttentionParallelConfig:
    """Attention: tensor parallel x context parallel x data parallel."""

    tp_size: int = 1
    cp_size: int = 1
    dp_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("AttentionParallelConfig", "tp_size", self.tp_size)
        _check_int("AttentionParallelConfig", "cp_size", self.cp_size)
        if self.dp_size is not None:
            _check_int("AttentionParallelConfig", "dp_size", self.dp_size)

    def split_sizes(self) -> dict[str, int]:
        return {"tp": self.tp_size, "cp": self.cp_size}


@dataclass(frozen=True)
class MoeParallelConfig:
    """Mixture-of-experts layers: tensor parallel x expert parallel x data parallel."""

    tp_size: int = 1
    ep_size: int = 1
    dp_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("MoeParallelConfig", "tp_size", self.tp_size)
        _check_int("MoeParallelConfig", "ep_size", self.ep_size)
        if self.dp_size is not None:
            _check_int("MoeParallelConfig", "dp_size", self.dp_size)

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


@dataclass(frozen=True)
class EngineConfig:
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.device, DeviceConfig):
            raise TypeError(f"EngineConfig.device must be a DeviceConfig, got {self.device!r}")
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError(f"EngineConfig.parallel must be a ParallelConfig, got {self.parallel!r}")


@dataclass(frozen=True)
class EngineArgs:
    """What to serve: a plugin name, its arguments, and how to lay it out.

    ``plugin``: a registered name, a ``phyrt.plugins`` entry point, or a
    ``"package.module:EntryClass"`` string. ``plugin_args`` is handed to the
    plugin's ``build``; for the local and external modes it must be plain data
    (msgpack-able: dicts, lists, strings, numbers, bytes).
    """

    plugin: str
    plugin_args: Any = None
    config: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.plugin, str) or not self.plugin:
            raise TypeError(f"EngineArgs.plugin must be a non-empty plugin name, got {self.plugin!r}")
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"EngineArgs.config must be an EngineConfig, got {self.config!r}")


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class WorkerSupervisorConfig:
    """How the supervisor runs a local worker group.

    ``base_port``: replica i rendezvouses on ``base_port + i`` (loopback).
    ``execution_timeout_s``: a request not answered this long after submission
    (queued time included) fails its whole group; ``None`` waits forever.
    ``heartbeat_interval_s`` / ``heartbeat_timeout_s``: each rank beats every
    interval, from a thread that runs during forward passes; silence longer than
    the timeout fails the group.
    ``startup_timeout_s``: every rank must report ready within this.
    """

    base_port: int = 29500
    execution_timeout_s: float | None = None
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _check_int("WorkerSupervisorConfig", "base_port", self.base_port, minimum=1)
        if self.base_port > 65535:
            raise ValueError(f"WorkerSupervisorConfig.base_port must be <= 65535, got {self.base_port}")
        _check_seconds("WorkerSupervisorConfig", "execution_timeout_s", self.execution_timeout_s, allow_none=True)
        _check_seconds("WorkerSupervisorConfig", "heartbeat_interval_s", self.heartbeat_interval_s)
        _check_seconds("WorkerSupervisorConfig", "heartbeat_timeout_s", self.heartbeat_timeout_s)
        _check_seconds("WorkerSupervisorConfig", "startup_timeout_s", self.startup_timeout_s)
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "WorkerSupervisorConfig.heartbeat_timeout_s must exceed heartbeat_interval_s, got "
                f"timeout {self.heartbeat_timeout_s} <= interval {self.heartbeat_interval_s}"
            )


@dataclass(frozen=True)
class DeploymentConfig:
    """Where replicas run. ``mode="auto"`` resolves as the spec's table says:

    =====================================================  ==========
    one rank, one replica, no explicit ``devices``         inline
    more than one rank or replica, or explicit ``devices``  local
    ``DeploymentConfig.external()``                        external
    =====================================================  ==========

    ``devices`` are logical device indices (composing with ``CUDA_VISIBLE_DEVICES``);
    replica i takes entries ``[i*ranks, (i+1)*ranks)``. On a CPU target they only
    count rank slots.

    ``collective_timeout_s`` (external mode): once the ranks are built, a collective
    that gets no answer from a peer this long (a rank hung or died) fails with
    ``EngineUnavailableError`` instead of waiting torch's default 30 minutes.
    """

    mode: str = "auto"
    replica_count: int = 1
    devices: tuple[int, ...] | None = None
    process_config: WorkerSupervisorConfig = field(default_factory=WorkerSupervisorConfig)
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str):
            raise TypeError(f"DeploymentConfig.mode must be a string, one of {_MODES}, got {self.mode!r}")
        if self.mode not in _MODES:
            raise ValueError(f"DeploymentConfig.mode must be one of {_MODES}, got {self.mode!r}")
        _check_int("DeploymentConfig", "replica_count", self.replica_count)
        if self.devices is not None:
            if isinstance(self.devices, (str, bytes)) or not hasattr(self.devices, "__iter__"):
                raise TypeError(f"DeploymentConfig.devices must be a sequence of ints, got {self.devices!r}")
            devices = tuple(self.devices)
            for d in devices:
                if isinstance(d, bool) or not isinstance(d, int):
                    raise TypeError(f"DeploymentConfig.devices entries must be ints, got {d!r} in {devices}")
                if d < 0:
                    raise ValueError(f"DeploymentConfig.devices entries must be >= 0, got {d} in {devices}")
            if not devices:
                raise ValueError("DeploymentConfig.devices must not be empty (use None for no placement)")
            if len(set(devices)) != len(devices):
                raise ValueError(f"DeploymentConfig.devices must not repeat an entry, got {devices}")
            object.__setattr__(self, "devices", devices)
        if not isinstance(self.process_config, WorkerSupervisorConfig):
            raise TypeError(
                f"DeploymentConfig.process_config must be a WorkerSupervisorConfig, got {self.process_config!r}"
            )
        if self.process_config.base_port + self.replica_count - 1 > 65535:
            raise ValueError(
                f"replica i rendezvouses on base_port + i: base_port {self.process_config.base_port} "
                f"with {self.replica_count} replicas passes port 65535"
            )
        _check_seconds("DeploymentConfig", "collective_timeout_s", self.collective_timeout_s)
        if self.mode == "external" and self.replica_count != 1:
            raise ValueError(f"external mode serves one replica per launch, got replica_count={self.replica_count}")

    @classmethod
    def local(
        cls,
        devices: Any = None,
        replica_count: int = 1,
        process_config: WorkerSupervisorConfig | None = None,
    ) -> "DeploymentConfig":
        return cls(
            mode="local",
            replica_count=replica_count,
            devices=devices,
            process_config=process_config or WorkerSupervisorConfig(),
        )

    @classmethod
    def external(cls, collective_timeout_s: float = 60.0) -> "DeploymentConfig":
        """This process is one rank of a torchrun launch (see ``runtime.execution.external``)."""
        return cls(mode="external", collective_timeout_s=collective_timeout_s)

    def resolve_mode(self, ranks_per_replica: int) -> str:
        """The executor kind for a replica of ``ranks_per_replica`` ranks."""
        _check_int("resolve_mode", "ranks_per_replica", ranks_per_replica)
        if self.mode == "external":
            return "external"
        if self.mode == "inline":
            if ranks_per_replica != 1 or self.replica_count != 1:
                raise ValueError(
                    "inline mode runs one rank and one replica in the caller's process, got "
                    f"{ranks_per_replica} ranks per replica x {self.replica_count} replicas; use mode='local'"
                )
            return "inline"
        if self.mode == "local":
            return "local"
        if ranks_per_replica == 1 and self.replica_count == 1 and self.devices is None:
            return "inline"
        return "local"

    def placement(self, ranks_per_replica: int) -> list[tuple[int, ...]]:
        """Device entries of each replica's ranks: ``[(d0, d1), (d2, d3)]`` for 2x2.

        Without explicit devices, ranks count up from 0 in order.
        """
        _check_int("placement", "ranks_per_replica", ranks_per_replica)
        needed = self.replica_count * ranks_per_replica
        if self.devices is None:
            devices = tuple(range(needed))
        else:
            devices = self.devices
            if len(devices) != needed:
                raise ValueError(
                    f"DeploymentConfig.devices has {len(devices)} entries {devices}, but "
                    f"replica_count {self.replica_count} x ranks_per_replica {ranks_per_replica} = {needed}"
                )
        return [devices[i * ranks_per_replica:(i + 1) * ranks_per_replica] for i in range(self.replica_count)]
