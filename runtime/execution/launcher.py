"""What the launcher (torchrun, or another that sets its variables) says about this process:
its rank, world size, local rank and rendezvous address, checked before anything is built.

Imports ``runtime.core.config`` of the project; used by ``runtime.execution.external``.
"""

from __future__ import annotations

import os
from typing import Any

from runtime.core.config import DeploymentConfig, EngineArgs

__all__ = ["LAUNCHER_VARS", "launcher_env", "launch_checked"]

#: the environment a launcher must set (torchrun sets all of them)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launcher_env(environ: Any = None) -> dict[str, Any]:
    """RANK, WORLD_SIZE, LOCAL_RANK (ints) and MASTER_ADDR/PORT, or a ValueError."""
    environ = os.environ if environ is None else environ
    missing = [name for name in LAUNCHER_VARS if not environ.get(name)]
    if missing:
        raise ValueError(
            f"DeploymentConfig.external() must run in a process that torchrun started (or another "
            f"launcher that sets {', '.join(LAUNCHER_VARS)}); missing: {', '.join(missing)}. Run e.g. "
            "'torchrun --standalone --nproc-per-node 2 your_script.py', or use DeploymentConfig.local() "
            "to have phyrt start the ranks itself")
    env: dict[str, Any] = {"MASTER_ADDR": environ["MASTER_ADDR"]}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        try:
            env[name] = int(environ[name])
        except ValueError:
            raise ValueError(f"the launcher set {name}={environ[name]!r}, which is not an integer") from None
    if env["WORLD_SIZE"] < 1 or not 0 <= env["RANK"] < env["WORLD_SIZE"] or env["LOCAL_RANK"] < 0:
        raise ValueError(f"the launcher set RANK={env['RANK']}, WORLD_SIZE={env['WORLD_SIZE']}, "
                         f"LOCAL_RANK={env['LOCAL_RANK']}: need 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
    return env


def launch_checked(args: EngineArgs, deployment: DeploymentConfig) -> dict[str, Any]:
    """The launcher's variables, once they fit the deployment (``ValueError`` naming the rule otherwise)."""
    if deployment.devices is not None:
        raise ValueError(f"external mode takes each rank's device from LOCAL_RANK; leave "
                         f"DeploymentConfig.devices as None, got {deployment.devices}")
    parallel = args.config.parallel
    needed = parallel.infer_replica_world_size()
    env = launcher_env()
    if env["WORLD_SIZE"] != needed:
        raise ValueError(
            f"the launcher started WORLD_SIZE={env['WORLD_SIZE']} processes, but the ParallelConfig needs "
            f"{needed} ranks for its one replica (pipeline {parallel.outer.pipeline_size} x cfg "
            f"{parallel.outer.cfg_size} x partition {parallel.partition_size}); external mode serves "
            f"exactly one replica: launch {needed} processes in all (nnodes x nproc-per-node) or change "
            "the ParallelConfig")
    return env
