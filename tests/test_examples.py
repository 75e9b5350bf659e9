"""Every example runs as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_inline_engine_example():
    out = subprocess.run([sys.executable, "examples/inline_engine.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "mode=inline actions (4, 8, 7) torch.float32" in out.stdout
    assert "100 requests in" in out.stdout


@pytest.mark.timeout(180)
def test_local_replicas_example_matches_inline():
    import socket

    with socket.socket() as s:  # a free pair of ports for the two replicas' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "examples/local_replicas.py", "--base-port", str(port)], cwd=ROOT,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mode=local, 2 replicas x 2 ranks" in out.stdout
    assert "max |local - inline|" in out.stdout
