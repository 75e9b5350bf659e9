"""Configuration objects: frozen dataclasses, validated when they are built.

Leaf module: imports only ``runtime.core`` (``supervisor`` and ``workers`` import it,
never the other way round). It imports torch for dtypes; the torch-free client never
imports it. How a replica is cut up lives in ``runtime.core.parallel_config`` (its
names are importable from here too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.core.checks import check_int, check_seconds
from runtime.core.parallel_config import (DOMAINS, AttentionParallelConfig, DenseParallelConfig, MoeParallelConfig,
                                          OuterParallelConfig, ParallelConfig)

__all__ = ["AttentionParallelConfig", "DOMAINS", "DenseParallelConfig", "DeploymentConfig", "DeviceConfig",
           "EngineArgs", "EngineConfig", "MoeParallelConfig", "OuterParallelConfig", "ParallelConfig",
           "WorkerSupervisorConfig", "dtype_name"]

_TARGETS = ("auto", "cuda", "cpu")
_MODES = ("auto", "inline", "local", "external")
_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")


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


@dataclass(frozen=True)
class BatchingConfig:
    """Dynamic batching of an executing runner that defines ``execute_batch(requests) -> results``.

    With ``max_batch_size > 1`` a replica takes up to ``max_batch_size`` of its queued requests
    (highest priority first; requests whose tensors differ in more than the leading dimension go
    in separate batches, ``runtime.batching.batch_key``), waiting at most ``max_delay_ms`` after
    the first, and runs them in one ``execute_batch`` call. 1 (the default) runs one request per
    ``execute``; ``max_delay_ms`` is then unused.
    """

    max_batch_size: int = 1
    max_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        size = self.max_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 65536:
            raise ValueError(f"BatchingConfig.max_batch_size must be an int from 1 to 65536, got {size!r}")
        delay = self.max_delay_ms
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 60_000:
            raise ValueError(f"BatchingConfig.max_delay_ms must be a number of milliseconds from 0 to 60000, "
                             f"got {delay!r}")

    @property
    def enabled(self) -> bool:
        return self.max_batch_size > 1


@dataclass(frozen=True)
class EngineConfig:
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.device, DeviceConfig):
            raise TypeError(f"EngineConfig.device must be a DeviceConfig, got {self.device!r}")
        if not isinstance(self.parallel, ParallelConfig):
            raise TypeError(f"EngineConfig.parallel must be a ParallelConfig, got {self.parallel!r}")
        if not isinstance(self.batching, BatchingConfig):
            raise TypeError(f"EngineConfig.batching must be a BatchingConfig, got {self.batching!r}")


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

    ``base_port``: ``None`` (the default): each replica's ranks rendezvous through a
    file store in the supervisor's private run directory, so no TCP port is chosen
    here and any number of engines start side by side; an int pins replica i's
    rendezvous to ``127.0.0.1:base_port + i``.
    ``execution_timeout_s``: a request not answered this long after submission
    (queued time included) fails its whole group; ``None`` waits forever.
    ``heartbeat_interval_s`` / ``heartbeat_timeout_s``: each rank beats every
    interval, from a thread that runs during forward passes; silence longer than
    the timeout fails the group.
    ``startup_timeout_s``: every rank must report ready within this.
    """

    base_port: int | None = None
    execution_timeout_s: float | None = None
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.base_port is not None:
            if isinstance(self.base_port, bool) or not isinstance(self.base_port, int):
                raise TypeError("WorkerSupervisorConfig.base_port must be an int or None (a free rendezvous), "
                                f"got {self.base_port!r} ({type(self.base_port).__name__})")
            check_int("WorkerSupervisorConfig", "base_port", self.base_port, minimum=1)
            if self.base_port > 65535:
                raise ValueError(f"WorkerSupervisorConfig.base_port must be <= 65535, got {self.base_port}")
        check_seconds("WorkerSupervisorConfig", "execution_timeout_s", self.execution_timeout_s, allow_none=True)
        check_seconds("WorkerSupervisorConfig", "heartbeat_interval_s", self.heartbeat_interval_s)
        check_seconds("WorkerSupervisorConfig", "heartbeat_timeout_s", self.heartbeat_timeout_s)
        check_seconds("WorkerSupervisorConfig", "startup_timeout_s", self.startup_timeout_s)
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

    ``replica_restarts`` (local mode): a replica whose worker group failed is rebuilt in
    the background with new ranks, each replica up to this many times in the engine's
    life (a rebuild that fails to start counts); then it is given up. 0 (the default) keeps fail-fast: a failed replica stays down. The
    wait before rebuild k of a replica is ``restart_backoff_s * 2**(k-1)``, at most 60 s.
    Its requests fail at once either way; a rebuild never retries them. Inline and
    external mode ignore both: an inline replica never fails as a whole (a plugin error
    fails its request only), and torchrun restarts external ranks (``--max-restarts``).
    """

    mode: str = "auto"
    replica_count: int = 1
    devices: tuple[int, ...] | None = None
    process_config: WorkerSupervisorConfig = field(default_factory=WorkerSupervisorConfig)
    collective_timeout_s: float = 60.0
    replica_restarts: int = 0
    restart_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str):
            raise TypeError(f"DeploymentConfig.mode must be a string, one of {_MODES}, got {self.mode!r}")
        if self.mode not in _MODES:
            raise ValueError(f"DeploymentConfig.mode must be one of {_MODES}, got {self.mode!r}")
        check_int("DeploymentConfig", "replica_count", self.replica_count)
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
        base_port = self.process_config.base_port
        if base_port is not None and base_port + self.replica_count - 1 > 65535:
            raise ValueError(
                f"replica i rendezvouses on base_port + i: base_port {base_port} "
                f"with {self.replica_count} replicas passes port 65535; pass base_port=None (the default) "
                "for a free rendezvous"
            )
        check_seconds("DeploymentConfig", "collective_timeout_s", self.collective_timeout_s)
        check_int("DeploymentConfig", "replica_restarts", self.replica_restarts, minimum=0)
        check_seconds("DeploymentConfig", "restart_backoff_s", self.restart_backoff_s)
        if self.mode == "external" and self.replica_count != 1:
            raise ValueError(f"external mode serves one replica per launch, got replica_count={self.replica_count}")

    @classmethod
    def local(
        cls,
        devices: Any = None,
        replica_count: int = 1,
        process_config: WorkerSupervisorConfig | None = None,
        replica_restarts: int = 0,
        restart_backoff_s: float = 1.0,
    ) -> "DeploymentConfig":
        return cls(
            mode="local",
            replica_count=replica_count,
            devices=devices,
            process_config=process_config or WorkerSupervisorConfig(),
            replica_restarts=replica_restarts,
            restart_backoff_s=restart_backoff_s,
        )

    @classmethod
    def external(cls, collective_timeout_s: float = 60.0) -> "DeploymentConfig":
        """This process is one rank of a torchrun launch (see ``runtime.execution.external``)."""
        return cls(mode="external", collective_timeout_s=collective_timeout_s)

    def resolve_mode(self, ranks_per_replica: int) -> str:
        """The executor kind for a replica of ``ranks_per_replica`` ranks."""
        check_int("resolve_mode", "ranks_per_replica", ranks_per_replica)
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
        check_int("placement", "ranks_per_replica", ranks_per_replica)
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
