"""``python -m runtime.cluster.serve [runtime.launch options]``: ``runtime.launch`` that stops with its parent.

A Ray actor (``runtime.cluster.ray_fleet.ServerActor``) starts this with a pipe as stdin and
keeps the write end. When the actor's process ends, however it ends (``ray.kill``, a crash,
SIGKILL), the pipe reads EOF and the kernel sends this process SIGTERM: the server drains for
``--drain-timeout-s`` and exits as after Ctrl-C (or abandons its start), its ranks and
segments with it.

    actor process ---- stdin pipe (held open, never written) ----> this process
      exits: EOF  ----- kernel: SIGTERM (F_SETSIG on stdin) ------> runtime.launch.main: drain, exit 0

No thread watches the pipe: stdin is put in signal-driven mode (``O_ASYNC``, owner this
process, ``F_SETSIG`` SIGTERM), so its readiness (the EOF; the actor never writes) is the
signal itself. Linux only, as Ray's nodes here are.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys


def stop_at_eof(fd: int = 0) -> None:
    """Have the kernel send this process SIGTERM once ``fd`` (a pipe) reads EOF; SIGTERM now if it
    already does, or if ``fd`` is no pipe."""
    try:
        if not hasattr(fcntl, "F_SETSIG"):
            raise OSError("F_SETSIG is Linux's: runtime.cluster.serve runs on Linux")
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGTERM)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC | os.O_NONBLOCK)
        os.read(fd, 4096)  # b"": the parent left before we armed it
    except BlockingIOError:  # the pipe is open and empty: armed
        return
    except OSError:  # no pipe at all: stop as if it closed
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    from runtime.launch import main as launch

    stop_at_eof()  # after the import: runtime.launch's start handler takes the signal from here on
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
