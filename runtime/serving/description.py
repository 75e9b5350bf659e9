"""What a server says about itself: the ``info`` op's answer (docs/protocol.md section 3).

Imports ``runtime.link.client_protocol`` (the protocol's version) of the project; the engine is
read through its public properties only.

    describe(engine, who, load, extra)
      who    server_id, address                  (the server's identity)
      engine plugin, mode, replica_count, ranks_per_replica, replicas (health, in flight,
             devices, error, restarts, plugin_info: rank 0's runner, as its heartbeat said)
      load   inflight, max_inflight, accepting, shm
      versions (phyrt, protocol, python, torch, pyzmq, libzmq, msgpack, numpy: read once)
      extra  what the launcher adds (device, dtype, backend)
"""

from __future__ import annotations

import functools
import platform
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from runtime.link.client_protocol import PROTOCOL_VERSION

__all__ = ["describe", "versions"]


def describe(engine: Any, who: dict[str, Any], load: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The ``info`` answer of a server over ``engine`` (see the module)."""
    return {
        **who,
        "plugin": engine.args.plugin,
        "mode": engine.mode,
        "replica_count": len(engine.replicas),
        "ranks_per_replica": engine.ranks_per_replica,
        "replicas": [{"index": r.index, "healthy": r.healthy, "inflight": r.inflight,
                      "devices": list(r.devices), "error": r.error, "restarts": r.restarts,
                      "restarting": r.restarting, "plugin_info": r.plugin_info} for r in engine.replicas],
        **load,
        "versions": versions(),
        **extra,
    }


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, Any]:
    """The versions a server runs with (read once)."""
    from importlib import metadata

    try:
        phyrt_version = metadata.version("phyrt")
    except metadata.PackageNotFoundError:
        phyrt_version = "unknown"
    return {"phyrt": phyrt_version, "protocol": PROTOCOL_VERSION, "python": platform.python_version(),
            "torch": torch.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "msgpack": ".".join(map(str, msgpack.version)), "numpy": np.__version__}
