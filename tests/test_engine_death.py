"""The engine process SIGKILLed under its ranks, at each stage of its life.

    stage         what the engine subprocess (one replica of two ranks) is doing when killed
    startup       its ranks are spawned and still starting (importing torch, joining the group)
    idle          ready; a 16 MiB round trip made both sides' arenas grow; nothing in flight
    request       a request carrying 16 MiB (a grown request segment) sleeps in the plugin
    request_gil   a request holds the GIL inside the plugin, as a long C call does (no thread
                  of the rank can run: the kernel has to end it)

    this test ── SIGKILL ──> engine (python -c ENGINE_SCRIPT)
                               ├── rank 0 ┐ PR_SET_PDEATHSIG: the kernel SIGKILLs them when the
                               ├── rank 1 ┘ engine's spawn thread dies with the engine
                               └── multiprocessing's resource tracker (exits once the pipe is gone)

Each stage: every rank is gone within 2 s of the kill, and the whole tree soon after.
Then the next engine start in this process sweeps: no /dev/shm name of any of those runs
or processes, and no run directory, is left. ``test_local_lifecycle`` covers a request
that sleeps (no shared memory in flight); this extends it to the other stages.
"""

from __future__ import annotations

import glob
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (close_engine, group_pids, pid_alive, run_dirs, shm_names, start_engine, tp_parallel,
                            wait_until)

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]
ROOT = Path(__file__).resolve().parents[1]
#: the promise: no rank of a SIGKILLed engine is alive this long after the kill
RANK_EXIT_BOUND_S = 2.0

ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from tests.conftest import group_pids, start_engine, supervisor_of, tp_parallel, wait_until
    from tests.plugins import mark_files

    stage, mark = sys.argv[1], sys.argv[2]
    print(json.dumps({"engine_pid": os.getpid()}), flush=True)
    engine = start_engine("tests.plugins:KillProbe", parallel=tp_parallel(2), startup_timeout_s=120.0)
    x = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB each way: both sides' arenas grow
    assert torch.equal(engine.step({"op": "echo", "x": x}, timeout=60), x)
    if stage == "request":
        engine.submit({"op": "sleep", "s": 120.0, "x": torch.ones(4 << 20), "mark": mark})
    elif stage == "request_gil":
        engine.submit({"op": "hold_gil", "s": 10.0, "mark": mark})
    if stage.startswith("request"):  # the submitted request is inside the plugin on both ranks
        assert wait_until(lambda: len(mark_files(mark)) == 2, 60), mark_files(mark)
    sup = supervisor_of(engine)
    print(json.dumps({"run_id": sup.run_id, "pids": group_pids(engine, 0),
                      "in_plugin": len(mark_files(mark))}), flush=True)
    time.sleep(300)
""")

#: what each stage left, for the final sweep test and for docs/reliability.md
KILLED: dict[str, dict[str, Any]] = {}


def _read_line(proc: subprocess.Popen, timeout: float) -> dict | None:
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    try:
        if selector.select(timeout):
            line = proc.stdout.readline()
            return json.loads(line) if line else None
        return None
    finally:
        selector.close()


def _descendants(pid: int) -> dict[int, str]:
    """pid -> "tracker" or "rank", for every live descendant of ``pid``."""
    found = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            tracker = any("resource_tracker" in part for part in child.cmdline())
        except psutil.NoSuchProcess:
            continue
        found[child.pid] = "tracker" if tracker else "rank"
    return found


def _shm_by(pids: set[int]) -> list[str]:
    names = []
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == "phyrt" and parts[2].isdigit() and int(parts[2]) in pids:
            names.append(name)
    return sorted(names)


def _imports_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped (it is importing torch, or past that)."""
    try:
        return any("libtorch" in m.path for m in psutil.Process(pid).memory_maps(grouped=True))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def kill_engine_at(stage: str, log: Path) -> dict[str, Any]:
    """Run the engine script up to ``stage``, SIGKILL it, and watch its tree."""
    mark = str(log.with_suffix(".running"))
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, stage, mark], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    tree: dict[int, str] = {}
    try:
        first = _read_line(proc, 60)
        assert first is not None, log.read_text()[-3000:]
        engine_pid = first["engine_pid"]
        if stage == "startup":
            assert wait_until(lambda: list(_descendants(engine_pid).values()).count("rank") >= 2, 60), \
                log.read_text()[-3000:]
            # both ranks are importing torch (or joining the group): started, not ready
            assert wait_until(lambda: all(_imports_torch(p) for p, kind in _descendants(engine_pid).items()
                                          if kind == "rank"), 60), log.read_text()[-3000:]
            info = None
        else:
            info = _read_line(proc, 120)
            assert info is not None, log.read_text()[-3000:]
        tree = _descendants(engine_pid)
        ranks = [p for p, kind in tree.items() if kind == "rank"]
        assert len(ranks) == 2, tree
        assert all(pid_alive(p) for p in ranks)
        [run_dir] = glob.glob(os.path.join(tempfile.gettempdir(), f"phyrt-*-{engine_pid}-*"))
        run_id = os.path.basename(run_dir).split("-")[1]

        proc.kill()
        killed_at = time.monotonic()
        proc.wait(10)
        gone = wait_until(lambda: not any(pid_alive(p) for p in ranks), 15.0, 0.01)
        ranks_gone_s = time.monotonic() - killed_at
        tree_gone = wait_until(lambda: not any(pid_alive(p) for p in tree), 10.0, 0.05)
        late = proc.stdout.read()  # the ranks held the pipe open; empty once they are gone
        return {"stage": stage, "run_id": run_id, "engine_pid": engine_pid, "ranks": ranks, "tree": tree,
                "ranks_gone": gone, "ranks_gone_s": ranks_gone_s, "tree_gone": tree_gone,
                "ready_before_kill": info is not None or bool(late.strip()),
                "ranks_in_plugin_at_kill": (info or {}).get("in_plugin", 0),
                "shm_right_after": sorted(set(shm_names(run_id)) | set(_shm_by({engine_pid, *tree}))),
                "run_dir_right_after": os.path.isdir(run_dir)}
    finally:
        for pid in tree:  # whatever outlived the test's bound: as kill -9 of the whole tree would
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize("stage", ["startup", "idle", "request", "request_gil"])
def test_ranks_exit_within_2s_of_their_engines_sigkill(stage, tmp_path):
    result = kill_engine_at(stage, tmp_path / f"engine-{stage}.log")
    KILLED[stage] = result
    assert result["ranks_gone"] and result["ranks_gone_s"] <= RANK_EXIT_BOUND_S, \
        f"ranks {result['ranks']} alive {result['ranks_gone_s']:.1f} s after the engine's SIGKILL"
    assert result["tree_gone"], f"left of the tree: {[p for p in result['tree'] if pid_alive(p)]}"
    assert result["ready_before_kill"] == (stage != "startup")
    assert result["ranks_in_plugin_at_kill"] == (2 if stage.startswith("request") else 0), result


def test_the_next_start_leaves_nothing_of_the_killed_engines():
    """Whatever the killed trees left linked, the next engine start sweeps (their pids are dead)."""
    if not KILLED:
        pytest.skip("no engine was killed in this session (run the whole module)")
    close_engine(start_engine())
    for stage, result in KILLED.items():
        pids = {result["engine_pid"], *result["tree"]}
        assert shm_names(result["run_id"]) == [], (stage, shm_names(result["run_id"]))
        assert _shm_by(pids) == [], (stage, _shm_by(pids))
        assert run_dirs(result["run_id"]) == [], (stage, run_dirs(result["run_id"]))
    out = os.environ.get("PHYRT_FIGURES_DIR")
    if out:
        with open(os.path.join(out, "engine_death.json"), "w") as f:
            json.dump({s: {k: v for k, v in r.items() if k != "tree"} for s, r in KILLED.items()}, f, indent=1)


def test_an_engine_built_in_a_thread_that_ends_keeps_its_ranks():
    """The ranks die with the thread that forked them (PR_SET_PDEATHSIG), so the supervisor
    forks them from a thread of its own: the caller's thread may end at once."""
    import threading

    built = []
    thread = threading.Thread(target=lambda: built.append(start_engine(parallel=tp_parallel(2))))
    thread.start()
    thread.join(120)
    [engine] = built
    try:
        pids = group_pids(engine, 0)
        # the thread is gone from the kernel too (a death signal tied to it has been sent by then)
        assert wait_until(lambda: not os.path.exists(f"/proc/self/task/{thread.native_id}"), 10)
        assert wait_until(lambda: not all(pid_alive(p) for p in pids), 0.5) is False, "a rank died with the thread"
        assert engine.step({"op": "echo", "x": 3}, timeout=60) == 3
        assert all(r.healthy for r in engine.replicas)
    finally:
        close_engine(engine)
