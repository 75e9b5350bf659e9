"""The rank processes as the operating system sees them: how one died, how to stop
a group (SIGTERM, a grace, SIGKILL), whether a rendezvous port is free, and the
removal of run directories whose engine process no longer exists.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import tempfile
import time
from typing import Any

#: a rank that does not exit this long after SIGTERM gets SIGKILL
TERM_GRACE_S = 2.0


def describe_exit(process: Any) -> str:
    process.join(0.1)
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_ranks(processes: list[Any], polite: bool = False) -> None:
    """SIGTERM (after a polite shutdown message, a moment to exit), then SIGKILL."""
    deadline = time.monotonic() + (TERM_GRACE_S if polite else 0.0)
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + TERM_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)


def sweep_run_dirs() -> None:
    """Remove run directories left by engine processes that no longer exist."""
    pattern = re.compile(r"phyrt-[0-9a-f]+-([0-9]+)-")
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        match = pattern.match(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # its owner lives (or the pid was reused: leave it, it is only a directory)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue


def check_port_free(port: int, replica: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ValueError(
                f"rendezvous port {port} of replica {replica} (base_port + {replica}) is taken: {exc}; "
                "set WorkerSupervisorConfig(base_port=...) to a free range"
            ) from None
