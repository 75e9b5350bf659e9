"""phyrt servers placed and restarted by Ray: the optional extra ``pip install 'phyrt[ray]'``.

Ray only places, restarts and hands out addresses and CURVE keys; requests never go
through Ray (an actor call costs ~0.8 ms, a phyrt round trip ~0.1 ms): they go straight
from a ``Client([address, ...])`` (``runtime.client.routing``) to the servers over ZeroMQ.

Modules: ``ray_fleet`` (``RayFleet``: one ``ServerActor`` per Ray node or per GPU set, each
running ``python -m runtime.cluster.serve`` on tcp:// with CURVE), ``serve`` (``runtime.launch``
that stops when its parent's pipe closes), ``__main__`` (the CLI, ``python -m runtime.cluster``).
``from runtime.cluster import RayFleet`` imports ``ray`` then, not before (PEP 562); nothing else
of ``runtime`` imports this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RayFleet", "ServerActor"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'runtime.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module("runtime.cluster.ray_fleet"), name)
