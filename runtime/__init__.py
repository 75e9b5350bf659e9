"""phyrt's public API.

Names are handed out lazily (PEP 562) so that ``import runtime.client`` works on a
machine without torch, and so that ``runtime -> supervisor -> runtime.core.config`` has
no import cycle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "runtime.engine",
    "ReplicaStatus": "runtime.engine",
    "EngineArgs": "runtime.core.config",
    "EngineConfig": "runtime.core.config",
    "BatchingConfig": "runtime.core.config",
    "DeviceConfig": "runtime.core.config",
    "ParallelConfig": "runtime.core.config",
    "OuterParallelConfig": "runtime.core.config",
    "DenseParallelConfig": "runtime.core.config",
    "AttentionParallelConfig": "runtime.core.config",
    "MoeParallelConfig": "runtime.core.config",
    "DeploymentConfig": "runtime.core.config",
    "WorkerSupervisorConfig": "runtime.core.config",
    "Entry": "runtime.core.plugins",
    "BuildContext": "runtime.core.plugins",
    "register_plugin": "runtime.core.plugins",
    "Partial": "runtime.core.plugins",
    "EngineUnavailableError": "runtime.core.errors",
    "WorkerStartupError": "runtime.core.errors",
    "ProtocolError": "runtime.core.errors",
    "RemoteError": "runtime.core.errors",
}

#: public submodules, imported on first use: ``runtime.parallel``, ``runtime.batching``
_SUBMODULES = ("batching", "parallel")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"runtime.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
