"""The names of phyrt's shared-memory segments, and the sweeps that remove stale ones.

Leaf module: standard library and ``owners`` (whether a creator lives: psutil tells a reused pid) only; no torch.

A segment is ``/dev/shm/phyrt-{run_id}-{creator_pid}-{seq}``: the run it belongs to, the
process that created it (its only owner), and a process-wide sequence number. A killed
process runs no cleanup, so its still-linked names stay; the sweeps remove them:
``sweep_stale()`` the names whose creator pid is dead (or reused by a younger process),
``sweep_run(run_id)`` every name of one run, ``sweep_creators(run_id, pids)`` those of
some of its processes (dead, reaped ranks). A sweep only touches names that parse as
ours and belong to this uid, and never raises on what it finds there.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable

from runtime.transport.owners import owner_alive

SHM_DIR = "/dev/shm"
_RUN_ID_RE = re.compile(r"[0-9a-f]{4,32}")
NAME_RE = re.compile(r"phyrt-([0-9a-f]{4,32})-([1-9][0-9]{0,9})-([0-9]{1,12})")


def new_run_id() -> str:
    """A fresh run id: 8 hex digits."""
    return secrets.token_hex(4)


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"run_id must be 4 to 32 lowercase hex digits, got {run_id!r}")
    return run_id


def unlink_quiet(name: str) -> bool:
    """Remove one stale name; never raises. A sweep meets whatever a killed process left
    under a name of ours (a forged one too: a directory, a link, another user's file)."""
    path = os.path.join(SHM_DIR, name)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:  # already unlinked, e.g. by a sweep
        return False
    except IsADirectoryError:
        try:
            os.rmdir(path)  # only if empty: nothing of ours lives in a directory
            return True
        except OSError:
            return False
    except OSError:  # not ours to remove (permissions, a read-only mount): leave it
        return False


def _entries(prefix: str) -> list[tuple[str, re.Match[str]]]:
    """Names under SHM_DIR that start with ``prefix``, parse as ours and belong to this uid."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = NAME_RE.fullmatch(name) if name.startswith(prefix) else None
        try:
            if match and os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False).st_uid == os.getuid():
                found.append((name, match))
        except FileNotFoundError:  # unlinked meanwhile
            pass
    return found


def sweep_stale(prefix: str = "phyrt-") -> list[str]:
    """Unlink this user's phyrt names whose creator process is gone; return them."""
    stale = [n for n, m in _entries(prefix) if not owner_alive(int(m.group(2)), os.path.join(SHM_DIR, n))]
    return sorted(n for n in stale if unlink_quiet(n))


def sweep_creators(run_id: str, pids: Iterable[int]) -> list[str]:
    """Unlink every name of one run created by one of ``pids``; return them.

    For processes known to be dead and reaped (e.g. the ranks of a failed group):
    a name is only ever created by its owner, so none can appear after this."""
    check_run_id(run_id)
    wanted = {int(pid) for pid in pids}
    return sorted(n for n, m in _entries(f"phyrt-{run_id}-") if int(m.group(2)) in wanted and unlink_quiet(n))


def sweep_run(run_id: str) -> list[str]:
    """Unlink every name of one run, live owners' included; return them."""
    check_run_id(run_id)
    return sorted(n for n, _ in _entries(f"phyrt-{run_id}-") if unlink_quiet(n))
