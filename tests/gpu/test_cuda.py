"""Runs check_cuda.py where CUDA exists (skipped on CPU-only machines, CI); its own verdict
logic (``--self-test``) runs everywhere."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path():
    out = subprocess.run([sys.executable, "tests/gpu/check_cuda.py"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(120)
def test_check_cuda_verdicts_are_computed():
    """check_cuda.py's verdicts, skips and exit codes on made-up inputs (no GPU needed)."""
    out = subprocess.run([sys.executable, "tests/gpu/check_cuda.py", "--self-test"], cwd=ROOT, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0 and "self-test: ok" in out.stdout, out.stdout + out.stderr
