"""What a killed server or engine leaves in the temporary directory, and the sweeps that remove it
(``runtime.transport.owners``): a directory whose maker is gone goes; one whose maker lives, or
that names no maker, stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from runtime.transport.owners import owner_alive, sweep_run_dirs, sweep_serve_dirs

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    return child.pid


def test_a_killed_servers_socket_directory_is_removed_by_the_next_sweep(tmp_path):
    """A process makes its socket directory (as ``python -m runtime.launch`` does) and is killed
    with SIGKILL: while it lives a sweep keeps the directory; once it is gone the sweep removes it."""
    code = ("from runtime.transport.owners import make_serve_dir; import os, time; d = make_serve_dir(); "
            "open(os.path.join(d, 'phyrt.sock'), 'w').close(); print(d, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)},
                             stdout=subprocess.PIPE, text=True)
    try:
        made = child.stdout.readline().strip()
        assert os.path.dirname(made) == str(tmp_path)
        assert os.path.basename(made).startswith(f"phyrt-serve-{child.pid}-")
        assert os.stat(made).st_mode & 0o777 == 0o700
        assert sweep_serve_dirs(str(tmp_path)) == [] and os.path.isdir(made)  # its server lives
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
    assert sweep_serve_dirs(str(tmp_path)) == [made]
    assert not os.path.exists(made)


def test_a_sweep_keeps_what_is_not_a_dead_makers_directory(tmp_path):
    """Kept: this process's own directory, one that names no pid (made before the pid was in the
    name: nothing says whose it is), a plain file and a link under a dead pid's name, other names."""
    dead = dead_pid()
    mine = tmp_path / f"phyrt-serve-{os.getpid()}-live"
    kept = [mine, tmp_path / "phyrt-serve-abcd1234", tmp_path / "phyrt-serve-0-x", tmp_path / "other-dir"]
    for path in kept:
        path.mkdir()
    plain = tmp_path / f"phyrt-serve-{dead}-file"
    plain.write_text("")
    link = tmp_path / f"phyrt-serve-{dead}-link"
    link.symlink_to(tmp_path / "other-dir")
    gone = tmp_path / f"phyrt-serve-{dead}-gone"
    gone.mkdir()
    (gone / "phyrt.sock").write_text("")
    assert sweep_serve_dirs(str(tmp_path)) == [str(gone)]
    assert all(path.is_dir() for path in kept)
    assert plain.is_file() and link.is_symlink() and (tmp_path / "other-dir").is_dir()


def test_run_directories_and_socket_directories_are_swept_by_their_own_sweep(tmp_path):
    """A supervisor's run directory ``phyrt-{run_id}-{pid}-``: removed by ``sweep_run_dirs`` once
    its engine process is gone, never by the servers' sweep, and the other way round."""
    dead = dead_pid()
    run_dir = tmp_path / f"phyrt-0123abcd-{dead}-x"
    serve_dir = tmp_path / f"phyrt-serve-{dead}-x"
    live_run_dir = tmp_path / f"phyrt-0123abcd-{os.getpid()}-y"
    for path in (run_dir, serve_dir, live_run_dir):
        path.mkdir()
    assert sweep_serve_dirs(str(tmp_path)) == [str(serve_dir)]
    assert run_dir.is_dir()
    assert sweep_run_dirs(str(tmp_path)) == [str(run_dir)]
    assert live_run_dir.is_dir()


def test_a_reused_pid_is_no_owner(tmp_path):
    """A live process younger than the directory cannot have made it: its pid was reused."""
    old = tmp_path / "old"
    old.mkdir()
    time.sleep(1.5)  # the check allows 1 s of clock slack
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        young = tmp_path / "young"
        young.mkdir()
        assert owner_alive(child.pid, str(young)) is True
        assert owner_alive(child.pid, str(old)) is False
    finally:
        child.kill()
        child.wait(30)
    assert owner_alive(child.pid, str(young)) is False
