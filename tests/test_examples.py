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
