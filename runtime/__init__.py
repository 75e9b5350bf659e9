"""phyrt's public API.

Names are handed out lazily (PEP 562) so that ``import runtime.client`` works on a
machine without torch, and so that ``runtime -> supervisor -> runtime.config`` has
no import cycle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "runtime.engine",
    "ReplicaStatus": "runtime.engine",
    "EngineArgs": "runtime.config",
    "EngineConfig": "runtime.config",
    "DeviceConfig": "runtime.config",
    "ParallelConfig": "runtime.config",
    "OuterParallelConfig": "runtime.config",
    "DenseParallelConfig": "runtime.config",
    "AttentionParallelConfig": "runtime.config",
    "MoeParallelConfig": "runtime.config",
    "DeploymentConfig": "runtime.config",
    "WorkerSupervisorConfig": "runtime.config",
    "Entry": "runtime.plugins",
    "BuildContext": "runtime.plugins",
    "register_plugin": "runtime.plugins",
    "EngineUnavailableError": "runtime.errors",
    "WorkerStartupError": "runtime.errors",
    "ProtocolError": "runtime.errors",
    "RemoteError": "runtime.errors",
}

__all__ = sorted(_EXPORTS) + ["parallel"]


def __getattr__(name: str) -> Any:
    if name == "parallel":
        return importlib.import_module("runtime.parallel")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
