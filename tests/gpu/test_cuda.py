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


@pytest.mark.timeout(120)
def test_run_all_names_existing_files_and_says_it_skips_without_cuda():
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import run_all
    finally:
        sys.path.pop(0)
    missing = [f for f in run_all.DEVICE_SENSITIVE if not (ROOT / "tests" / f).is_file()]
    assert missing == []
    if torch.cuda.is_available():
        return  # on a GPU machine the runner itself is what runs
    out = subprocess.run([sys.executable, "tests/gpu/run_all.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0 and out.stdout.startswith("skip every check: no CUDA device"), out.stdout + out.stderr
