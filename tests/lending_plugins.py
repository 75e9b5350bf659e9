"""Test plugin for ``Engine.empty``: ``Peek`` reads its input only once the caller says so.

Request ``{"x": tensor, "gate": path | None}``: waits (at most 20 s) until the file ``gate``
exists, then answers ``{"first": x.flatten()[0], "sum": x.sum()}`` as floats. A caller that
writes ``x`` after submitting and then creates the gate learns whether the rank read its very
memory (no copy) or a copy made at submit.
"""

from __future__ import annotations

import os
import time
from typing import Any

from runtime import Entry


class PeekRunner:
    def execute(self, request: dict) -> Any:
        gate = request.get("gate")
        deadline = time.monotonic() + 20.0
        while gate is not None and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        x = request["x"]
        return {"first": float(x.flatten()[0]), "sum": float(x.double().sum())}


class Peek(Entry):
    name = "tests-peek"

    def build(self, ctx, plugin_args):
        return PeekRunner()
