"""runtime.cluster.serve: a server started with a pipe as stdin stops, with its ranks and segments,
once the pipe's writer is gone (what a Ray actor's death looks like to it); no Ray needed."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tests.test_launch import ROOT, _alive, shm_names_of, wait_until

pytestmark = pytest.mark.timeout(180)


def _serve(tmp_path, *args: str) -> tuple[subprocess.Popen, object]:
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cluster.serve", "--device", "cpu",
                             "--address", f"ipc://{tmp_path}/s.sock", *args], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    return proc, log


def test_the_server_and_its_ranks_stop_when_the_parent_pipe_closes(tmp_path):
    proc, log = _serve(tmp_path, "--devices", "0,1", "--replicas", "2", "--plugin", "tests.plugins:Echo")
    try:
        line = proc.stdout.readline()
        assert line.startswith("phyrt ready "), (tmp_path / "serve.log").read_text()
        pids = {proc.pid} | {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(pids) >= 3  # the server and its two ranks (a replica each)
        proc.stdin.close()  # the actor died: its end of the pipe closed
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
        assert wait_until(lambda: not [p for p in pids if _alive(p)], 15.0)
        assert shm_names_of(pids) == []
        assert not os.path.exists(f"{tmp_path}/s.sock")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def test_a_parent_gone_before_the_start_stops_it_at_once(tmp_path):
    proc, log = _serve(tmp_path, "--plugin", "tests.plugins:Echo")
    proc.stdin.close()
    try:
        assert proc.wait(60) in (0, -15), (tmp_path / "serve.log").read_text()
        assert proc.stdout.read() == ""  # never ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
