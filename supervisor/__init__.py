"""Spawns and supervises the rank processes of local replicas (see supervisor.supervisor).

Names are handed out lazily (PEP 562): a rank process unpickles its target from
``supervisor.processes`` and must arm its parent-death signal before anything heavy
(torch, through the configs) is imported.
"""

from typing import Any

__all__ = ["WorkerSupervisor", "WorkerSupervisorConfig"]


def __getattr__(name: str) -> Any:
    if name == "WorkerSupervisor":
        from supervisor.supervisor import WorkerSupervisor

        return WorkerSupervisor
    if name == "WorkerSupervisorConfig":
        from runtime.core.config import WorkerSupervisorConfig

        return WorkerSupervisorConfig
    raise AttributeError(f"module 'supervisor' has no attribute {name!r}")
