"""What a killed phyrt process leaves behind, and the sweeps that remove it: one owner check for all.

Leaf module: standard library (and psutil, to tell a reused pid) only; no torch.

A process killed with SIGKILL (or by the OOM killer) runs no cleanup. Every thing phyrt makes
that would then stay carries its maker's pid in its name from the moment it exists, so that a
later process can tell whether the maker is gone:

    /dev/shm/phyrt-{run_id}-{pid}-{seq}     a shared-memory segment (``shm_names``)
    <tmp>/phyrt-{run_id}-{pid}-XXXXXXXX     a supervisor's run directory (ranks' sockets)
    <tmp>/phyrt-serve-{pid}-XXXXXXXX        a server's ipc:// socket directory (``python -m runtime.launch``)

``owner_alive(pid, path)`` is the one test: the process lives, is no zombie, and is not younger
than the path (else the pid was reused). Since the pid is in the name before the directory
exists (``mkdtemp``'s prefix), a server in the middle of starting is never taken for a dead one.
A sweep touches only this user's entries whose names parse as ours, keeps anything it is unsure
about (another user's process, no psutil) and never raises on what it finds.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile

try:  # optional: detects pid reuse and zombies, which os.kill(pid, 0) cannot
    import psutil
except ImportError:  # pragma: no cover - psutil is a declared dependency
    psutil = None

#: a supervisor's run directory: ``phyrt-{run_id}-{pid}-``
RUN_DIR_RE = re.compile(r"phyrt-[0-9a-f]{4,32}-([1-9][0-9]{0,9})-")
SERVE_DIR_PREFIX = "phyrt-serve-"
#: a server's socket directory: ``phyrt-serve-{pid}-`` (one without a pid, made before the pid was
#: in the name, is never swept: nothing says whose it is)
SERVE_DIR_RE = re.compile(r"phyrt-serve-([1-9][0-9]{0,9})-")


def owner_alive(pid: int, path: str) -> bool:
    """Whether process ``pid`` lives and can have made ``path``: False when it is gone, a zombie not
    yet reaped, or younger than ``path`` (its pid was reused); True when unsure."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # alive, another user's
        return True
    if psutil is None:
        return True
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # dead, not yet reaped
            return False
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
    try:
        # a process younger than the path cannot have made it: the pid was reused
        return created <= os.stat(path, follow_symlinks=False).st_ctime + 1.0
    except FileNotFoundError:
        return True  # gone already: nothing to sweep


def sweep_dirs(pattern: re.Pattern[str], root: str | None = None) -> list[str]:
    """Remove the directories in ``root`` (default: the temporary directory) whose name starts with
    ``pattern`` (group 1: the maker's pid), that belong to this user and whose maker is gone;
    return their paths."""
    root = tempfile.gettempdir() if root is None else root
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        match = pattern.match(name)
        if match is None:
            continue
        path = os.path.join(root, name)
        try:
            info = os.stat(path, follow_symlinks=False)
        except OSError:  # removed meanwhile
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or owner_alive(int(match.group(1)), path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return sorted(removed)


def make_serve_dir() -> str:
    """A fresh owner-only (0700) directory for a server's ipc:// socket, named after this process
    (``phyrt-serve-{pid}-``) so that a later server can tell when it is left over."""
    return tempfile.mkdtemp(prefix=f"{SERVE_DIR_PREFIX}{os.getpid()}-")


def sweep_serve_dirs(root: str | None = None) -> list[str]:
    """Remove the socket directories of servers that were killed (``kill -9``): this user's
    ``phyrt-serve-{pid}-*`` whose process is gone; return their paths."""
    return sweep_dirs(SERVE_DIR_RE, root)


def sweep_run_dirs(root: str | None = None) -> list[str]:
    """Remove the run directories of supervisors whose engine process is gone; return their paths."""
    return sweep_dirs(RUN_DIR_RE, root)
