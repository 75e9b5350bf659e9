"""Spawns and supervises the rank processes of local replicas (see supervisor.supervisor)."""

from runtime.core.config import WorkerSupervisorConfig
from supervisor.supervisor import WorkerSupervisor

__all__ = ["WorkerSupervisor", "WorkerSupervisorConfig"]
