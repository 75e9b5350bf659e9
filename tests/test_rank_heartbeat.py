"""A rank's heartbeat thread is its death watch where the kernel cannot kill it with its engine
(no ``prctl(PR_SET_PDEATHSIG)``): once its parent pid is not the one it started under (the engine
died and the rank was reparented), it exits with ``ORPHAN_EXIT`` at its next beat."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from runtime.link.rank_protocol import ORPHAN_EXIT
from tests.test_launch import ROOT

pytestmark = pytest.mark.timeout(60)

RANK = textwrap.dedent("""
    import sys, time, zmq
    from workers.main import _Heartbeat
    ctx = zmq.Context(1)
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{sys.argv[1]}/hb")
    beats = _Heartbeat(ctx, f"ipc://{sys.argv[1]}/hb", b"h-0-1", 0.05)
    assert router.poll(5000), "no heartbeat"
    print("beating", flush=True)
    if sys.argv[2] == "orphan":
        beats._parent = -1  # what a reparented rank sees: getppid() is no longer its engine's pid
    time.sleep(3)
    print("still here", flush=True)
""")


@pytest.mark.parametrize("case", ["orphan", "parent alive"])
def test_a_rank_whose_engine_is_gone_exits_at_its_next_heartbeat(tmp_path, case):
    out = subprocess.run([sys.executable, "-c", RANK, str(tmp_path), case], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    if case == "orphan":
        assert (out.returncode, out.stdout) == (ORPHAN_EXIT, "beating\n"), out.stderr
    else:
        assert (out.returncode, out.stdout) == (0, "beating\nstill here\n"), out.stderr
