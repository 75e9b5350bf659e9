"""Plugins used by the tests. Importable as ``tests.plugins:Name`` in any
interpreter started from the repository root (spawned ranks included)."""

from __future__ import annotations

import threading
import time
from typing import Any

from runtime import Entry

#: set by tests to hold the inline runner inside execute(); only meaningful inline
gate = threading.Event()
gate.set()
#: what ran, in order (inline only: the runner lives in the test's process)
log: list[Any] = []


class EchoRunner:
    def execute(self, request: Any) -> Any:
        log.append(request)
        if isinstance(request, dict):
            if request.get("wait_gate"):
                gate.wait(30)
            if "sleep" in request:
                time.sleep(request["sleep"])
            if "raise" in request:
                raise {"KeyError": KeyError, "ZeroDivisionError": ZeroDivisionError,
                       "SystemExit": SystemExit}[request["raise"]](request.get("message", "boom"))
        return request


class Echo(Entry):
    """Returns the request; dict keys "sleep", "wait_gate" and "raise" steer it."""

    name = "echo"

    def validate_request(self, request: Any) -> None:
        if isinstance(request, dict) and request.get("invalid"):
            raise ValueError("request marked invalid")

    def build(self, ctx, plugin_args):
        if isinstance(plugin_args, dict) and plugin_args.get("fail_build"):
            raise RuntimeError("build failed on purpose")
        return EchoRunner()


class BatchingRunner:
    """A stepped runner: every request needs ``request`` steps; records batch sizes."""

    def __init__(self) -> None:
        self.remaining: dict[Any, int] = {}
        self.batches: list[int] = []

    def add(self, request_id: Any, request: int) -> None:
        if not isinstance(request, int) or request < 1:
            raise ValueError(f"steps must be a positive int, got {request!r}")
        self.remaining[request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.remaining)

    def step(self) -> list[tuple[Any, Any]]:
        gate.wait(30)
        self.batches.append(len(self.remaining))
        done = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            if self.remaining[request_id] == 0:
                del self.remaining[request_id]
                done.append((request_id, {"batches_seen": list(self.batches)}))
        return done


class Batching(Entry):
    name = "batching"

    def build(self, ctx, plugin_args):
        return BatchingRunner()
