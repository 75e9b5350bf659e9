"""``python -m runtime.cluster`` where no Ray cluster runs: one line that says how to start one.

No Ray is started here (the cluster itself is tests/test_ray_cluster.py's): the command must
answer at once, with phyrt's own flag names, and leave no Ray process or key behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.test_launch import ROOT

pytest.importorskip("ray", reason="Ray is the optional extra phyrt[ray]: pip install -e '.[test,ray]'")


def _running_ray_clusters() -> list[int]:
    """Ray's own test of a running cluster on this machine (a process with --gcs-address)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(arg.startswith("--gcs-address") for arg in proc.info["cmdline"] or ()):
            found.append(proc.info["pid"])
    return found


def _processes_with(marker: str) -> list[str]:
    """Processes that inherited ``marker`` in their environment (so: started by the command)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("PHYRT_TEST_MARKER") == marker:
                found.append(f"{proc.info['pid']} {' '.join(proc.info['cmdline'] or ())[:120]}")
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.timeout(90)
def test_without_a_running_ray_cluster_the_cli_says_in_one_line_how_to_start_one(tmp_path):
    if _running_ray_clusters():
        pytest.skip("a Ray cluster runs on this machine: --ray-address auto would join it")
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PHYRT_TEST_MARKER=marker, TMPDIR=str(tmp_path), RAY_TMPDIR=str(tmp_path))  # no stale /tmp/ray
    keys, listed = tmp_path / "keys", tmp_path / "fleet.json"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "runtime.cluster", "--keys-dir", str(keys), "--addresses-file",
                          str(listed), "--", "--plugin", "policy"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert out.returncode == 1, out
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("phyrt cluster: no running Ray cluster found: ")
    assert "`ray start --head`" in out.stderr and "--ray-address local" in out.stderr
    assert "--address flag" not in out.stderr  # Ray's own wording names a flag phyrt does not have
    assert elapsed < 30, elapsed  # no wait for a cluster that is not there
    assert not keys.exists() and not listed.exists()
    assert _processes_with(marker) == []  # it started no Ray of its own


@pytest.mark.timeout(60)
def test_without_ray_installed_the_cli_says_how_to_install_it(tmp_path):
    fake = tmp_path / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")  # as if not installed
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-m", "runtime.cluster", "--keys-dir", str(tmp_path / "keys"),
                          "--addresses-file", str(tmp_path / "fleet.json"), "--", "--plugin", "policy"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "Ray is not installed" in out.stderr and "pip install 'phyrt[ray]'" in out.stderr
    assert not (tmp_path / "keys").exists()
